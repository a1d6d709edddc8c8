"""RLHF: the InstructGPT pipeline of DeepSpeed-Chat (SFT, reward model, PPO) on four roles.

config (the recipe), data (the bundled task, JSON-lines data), experience (the dataclasses that
cross Ray), algorithms (the PPO maths), lm / batch / common (models, tokens, optimizers of a
role), roles (the four roles in plain torch), workers (the same as graph workers, with their
dispatch), stages (steps 1 and 2, evaluation), ppo (step 3), driver (the graph and the run)."""

from troupe.rlhf.config import RLHFConfig
from troupe.rlhf.workers import CriticActor, PolicyActor, ReferenceActor, RewardActor

__all__ = ["CriticActor", "PolicyActor", "RLHFConfig", "ReferenceActor", "RewardActor"]
