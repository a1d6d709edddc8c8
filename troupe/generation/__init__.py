"""Generation: the continuous batcher with its KV cache and one sampler, shared by serving and
the RLHF rollouts (speculative decoding by prompt lookup or a ``DraftModel``; a fixed-shape
decode step for CUDA graphs). Plain torch, no Ray."""

from troupe.generation.draft import DraftModel
from troupe.generation.engine import ContinuousBatcher
from troupe.generation.sampling import SamplingParams, checked, sample
from troupe.generation.sequence import Event

__all__ = ["ContinuousBatcher", "DraftModel", "Event", "SamplingParams", "checked", "sample"]
