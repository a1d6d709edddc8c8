"""Generation: the continuous batcher with its KV cache and one sampler, shared by serving and
the RLHF rollouts. Plain torch, no Ray."""

from troupe.generation.engine import ContinuousBatcher
from troupe.generation.sampling import SamplingParams, checked, sample
from troupe.generation.sequence import Event

__all__ = ["ContinuousBatcher", "Event", "SamplingParams", "checked", "sample"]
