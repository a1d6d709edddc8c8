"""RLHF: the InstructGPT pipeline of DeepSpeed-Chat (SFT, reward model, step 3: PPO and the
newer RL algorithms, or DPO) on four roles.

Its rooms, each importing only those listed before it (tests/test_layers.py):
config and algorithms (the recipe, one object per step-3 algorithm), data (rows, batches, what
crosses Ray), sandbox (the user's code in processes of its own), models (a role's model and
trainer), agents (multi-turn rollouts and their environments), rollout (the generation engine),
roles (the four roles and their actors), pipeline (what the driver runs over them); then
driver, plan, plots and cli (the app)."""

from troupe.rlhf.config import RLHFConfig
from troupe.rlhf.roles.actors import CriticActor, PolicyActor, ReferenceActor, RewardActor

__all__ = ["CriticActor", "PolicyActor", "RLHFConfig", "ReferenceActor", "RewardActor"]
