"""Serving: continuous batching over a (quantized) GPT with a KV cache, and the
OpenAI-compatible request and response formats. Plain torch and pydantic, no Ray: the
ServeReplica actor (troupe.actors.serve) and the Ray Serve app (troupe.runtime.serve) use it."""

from troupe.serving.engine import ContinuousBatcher, Event, SamplingParams

__all__ = ["ContinuousBatcher", "Event", "SamplingParams"]
