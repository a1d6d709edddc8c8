"""RLHF: the InstructGPT pipeline of DeepSpeed-Chat (SFT, reward model, step 3: PPO and the
newer RL algorithms, or DPO) on four roles.

config (the recipe), data (the bundled task, JSON-lines data), experience (the dataclasses that
cross Ray), algorithms (one object per step-3 algorithm and their tensor maths), lm / batch /
common (models, tokens, optimizers of a role), roles (the four roles in plain torch), rollout
(the policy's rollout engine), workers (the roles as graph workers, with their dispatch),
stages (steps 1 and 2, evaluation), scoring (step 3's batch: sampling, rewards, experience),
step3 (step 3's loop of the online algorithms), dpo (step 3 of DPO), rewards (reward
functions in their own processes), driver (the graph and the run)."""

from troupe.rlhf.config import RLHFConfig
from troupe.rlhf.workers import CriticActor, PolicyActor, ReferenceActor, RewardActor

__all__ = ["CriticActor", "PolicyActor", "RLHFConfig", "ReferenceActor", "RewardActor"]
