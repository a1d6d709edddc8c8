"""The four RLHF roles as graph workers: thin shells that build the plain role classes of
troupe.rlhf once their data-parallel groups are wired ("policy", "critic", "reward")."""

from __future__ import annotations

import torch

from troupe import collectives
from troupe.config import validate
from troupe.rlhf.config import RLHFConfig
from troupe.rlhf.roles import Critic, Policy, Reference, Reward
from troupe.runtime.context import get_context
from troupe.training import checkpoint as ckpt


def _config(config: dict | RLHFConfig) -> RLHFConfig:
    return config if isinstance(config, RLHFConfig) else validate(RLHFConfig, config,
                                                                  "rlhf config")


def _save_state(role: Policy | Critic, name: str, directory: str) -> dict:
    """Write this rank's PPO state as <directory>/<name>-RRRRR.trp; its manifest entry."""
    return ckpt.write_rank(directory, get_context().rank, role.state_dict(), prefix=name)


def _load_state(role: Policy | Critic, name: str, directory: str) -> None:
    rank = get_context().rank
    state = ckpt.read_rank(directory, rank, ckpt.read_manifest(directory), prefix=name)
    role.load_state_dict(state, str(ckpt.rank_file(directory, rank, name)))


class PolicyActor:
    def __init__(self, config: dict | RLHFConfig):
        self.cfg, self.role = _config(config), None

    def setup(self) -> None:
        self.role = Policy(self.cfg, collectives.find_group("policy"), get_context().rank)

    def start_sft(self, total_steps: int) -> None:
        self.role.train.use_optimizer(self.cfg.sft.optimizer, total_steps)

    def sft_step(self, pairs: list[tuple[str, str]], step: int) -> dict:
        return self.role.sft_step(pairs, step)

    def begin_ppo(self, sft_path: str) -> None:
        self.role.begin_ppo(sft_path)

    def generate(self, prompts: list[str], seed: int, use_ema: bool = False,
                 temperature: float | None = None) -> dict:
        return self.role.generate(prompts, seed, use_ema, temperature)

    def logprobs(self, batch: dict) -> torch.Tensor:
        return self.role.logprobs(batch["ids"], batch["valid"])

    def ppo_step(self, exp: dict, iteration: int, ptx=None) -> dict:
        return self.role.ppo_step(exp, iteration, ptx)

    def save(self, path: str, ema: bool = False) -> str:
        return self.role.save(path, ema)

    def load(self, path: str) -> None:
        self.role.load(path)

    def save_state(self, directory: str) -> dict:
        return _save_state(self.role, "policy", directory)

    def load_state(self, directory: str) -> None:
        _load_state(self.role, "policy", directory)


class ReferenceActor:
    def __init__(self, config: dict | RLHFConfig):
        self.cfg, self.role = _config(config), None

    def setup(self) -> None:
        self.role = Reference(self.cfg, get_context().rank)

    def load(self, path: str) -> None:
        self.role.load(path)

    def logprobs(self, batch: dict) -> torch.Tensor:
        return self.role.logprobs(batch["ids"], batch["valid"])


class RewardActor:
    def __init__(self, config: dict | RLHFConfig):
        self.cfg, self.role = _config(config), None

    def setup(self) -> None:
        self.role = Reward(self.cfg, collectives.find_group("reward"), get_context().rank)

    def start_training(self, total_steps: int, init_path: str | None = None) -> None:
        if init_path is not None:
            self.role.init_from_policy(init_path)
        self.role.train.use_optimizer(self.cfg.reward.optimizer, total_steps)

    def rm_step(self, examples: list[tuple[str, str, str]], step: int) -> dict:
        return self.role.rm_step(examples, step)

    def evaluate(self, examples: list[tuple[str, str, str]]) -> dict:
        return self.role.evaluate(examples)

    def score(self, batch: dict) -> torch.Tensor:
        return self.role.score(batch["ids"], batch["valid"])

    def save(self, path: str) -> str:
        return self.role.save(path)

    def load(self, path: str) -> None:
        self.role.load(path)


class CriticActor:
    def __init__(self, config: dict | RLHFConfig):
        self.cfg, self.role = _config(config), None

    def setup(self) -> None:
        self.role = Critic(self.cfg, collectives.find_group("critic"), get_context().rank)

    def begin_ppo(self, reward_path: str) -> None:
        self.role.begin_ppo(reward_path)

    def values(self, batch: dict) -> torch.Tensor:
        return self.role.values(batch["ids"], batch["valid"])

    def critic_step(self, exp: dict, iteration: int) -> dict:
        return self.role.critic_step(exp, iteration)

    def save(self, path: str) -> str:
        return self.role.save(path)

    def load(self, path: str) -> None:
        self.role.load(path)

    def save_state(self, directory: str) -> dict:
        return _save_state(self.role, "critic", directory)

    def load_state(self, directory: str) -> None:
        _load_state(self.role, "critic", directory)
