"""The two roles with a value head: the pairwise reward model of step 2 (frozen in step 3) and
the critic of PPO, initialised from it and trained with the clipped value loss."""

from __future__ import annotations


import torch

from troupe.collectives import Communicator
from troupe.data import micro_batches
from troupe.devices import rng_state, set_rng_state, worker_device
from troupe.rlhf import algorithms
from troupe.rlhf.config import RLHFConfig
from troupe.rlhf.data.batch import completions
from troupe.rlhf.data.experience import (
    CriticStats,
    Experience,
    RewardEval,
    RewardStats,
)
from troupe.rlhf.models.build import build_lm, build_trainable
from troupe.rlhf.models.lm import ValueModel
from troupe.rlhf.roles.reference import quantize_frozen


class Reward:
    """The reward model: a value head on a language model, scored at the last real token."""

    def __init__(self, cfg: RLHFConfig, group: Communicator | None, rank: int,
                 tp: Communicator | None = None):
        self.cfg, self.rank = cfg, rank
        torch.manual_seed(cfg.seed * 1000 + 500 + rank // cfg.tp_of("reward"))
        self.device = worker_device(cfg.device)
        lm, self.tok = build_lm(cfg.model, cfg.seed + 1, cfg.precision, tools=cfg.env.tools,
                                tp=tp)
        self.model = ValueModel(lm).to(self.device)
        self.train = build_trainable(self.model, lm.gpt.blocks, group, cfg, self.device, tp)
        self.to_quantize = False  # set when load() freezes the model

    def _pairs(self, examples: list[tuple[str, str, str]]):
        P = [e[0] for e in examples]
        ids, valid, _ = completions(self.tok, P + P, [e[1] for e in examples]
                                    + [e[2] for e in examples])
        return ids.to(self.device), valid.to(self.device)

    def _loss(self, examples, backward: bool) -> tuple[float, int]:
        """The mean pairwise loss over ``examples`` (and its backward, micro-batch by
        micro-batch, when asked) and how many pairs the model ranks right."""
        loss, right = 0.0, 0
        for s in micro_batches(len(examples), self.cfg.reward.micro_batch_size):
            part = examples[s]
            ids, valid = self._pairs(part)
            values, B, end = self.model(ids, valid), len(part), last_real(valid)
            lo, sc, sr = algorithms.pairwise_loss(values[:B], values[B:], ids[:B], ids[B:],
                                                  end[:B], end[B:])
            lo = lo * B / len(examples)
            if backward:
                self.train.backward(lo)
            loss, right = loss + lo.item(), right + int((sc > sr).sum())
        return loss, right

    def rm_step(self, examples: list[tuple[str, str, str]], step: int) -> RewardStats:
        self.model.train()
        loss, right = self._loss(examples, backward=True)
        return RewardStats(loss, right / len(examples), self.train.step(step))

    @torch.no_grad()
    def evaluate(self, examples: list[tuple[str, str, str]]) -> RewardEval:
        self.model.eval()
        loss, right = self._loss(examples, backward=False)
        return RewardEval(loss, right, len(examples))

    @torch.no_grad()
    def score(self, ids: torch.Tensor, valid: torch.Tensor, prompt_len: int = 0) -> torch.Tensor:
        self.model.eval()
        if self.to_quantize:
            quantize_frozen(self.model.lm.gpt, ids)  # the value head stays fp32
            self.to_quantize = False
        out = []
        for s in self.model.lm.micro_batches(valid, self.cfg.step3.micro_batch_size):
            values = self.model(ids[s], valid[s], prompt_len)
            out.append(values[torch.arange(len(values), device=values.device),
                              last_real(valid[s])])
        self.train.settle()
        return torch.cat(out)

    def init_from_policy(self, path: str) -> None:
        """Start the body from a policy checkpoint (the value head stays at zero)."""
        self.train.load(path, self.model.lm)

    def save(self, path: str) -> str:
        """Rank 0 writes the weights (every rank calls: a partitioned model gathers)."""
        self.train.save(path, self.model, self.rank == 0, kind="reward")
        return path

    def load(self, path: str) -> None:
        """The trained reward model, frozen from here on (its gradients and optimizer state
        are freed first)."""
        self.train.release()
        self.train.load(path, self.model)
        self.to_quantize = self.cfg.step3.quantize_frozen == "w8a8"  # at the first score call


class Critic:
    """The value function, started from the reward model's weights (or, without one, from the
    SFT policy's body and a fresh head: ``begin_step3``)."""

    def __init__(self, cfg: RLHFConfig, group: Communicator | None, rank: int,
                 tp: Communicator | None = None):
        self.cfg, self.rank = cfg, rank
        self.device = worker_device(cfg.device)
        lm, _ = build_lm(cfg.model, cfg.seed + 1, cfg.precision, tokenizer=False, tp=tp)
        self.model = ValueModel(lm).to(self.device)
        self.train = build_trainable(self.model, lm.gpt.blocks, group, cfg, self.device, tp)

    def begin_step3(self, reward_path: str | None, sft_path: str | None = None) -> None:
        """Step 3 starts from the reward model's weights, head included; without a learned
        reward model, from the SFT policy's body (None: the model's own) and a fresh value
        head (zero: every value starts at 0)."""
        if reward_path is not None:
            self.train.load(reward_path, self.model)
        elif sft_path is not None:
            self.train.load(sft_path, self.model.lm)
        self.train.use_optimizer(self.cfg.step3.critic,
                                 self.cfg.step3.iterations * self.cfg.step3.ppo_epochs)

    @torch.no_grad()
    def values(self, ids: torch.Tensor, valid: torch.Tensor, prompt_len: int = 0) -> torch.Tensor:
        self.model.eval()
        out = torch.cat([self.model(ids[s], valid[s], prompt_len)[:, :-1]  # before each target
                         for s in self.model.lm.micro_batches(
                             valid, self.cfg.step3.micro_batch_size)])
        self.train.settle()
        return out

    def critic_step(self, exp: Experience, iteration: int) -> CriticStats:
        self.model.train()
        p = self.cfg.step3
        total, value_loss = exp.action.sum().clamp_min(1), 0.0
        for s in self.model.lm.micro_batches(exp.valid, p.micro_batch_size):
            values = self.model(exp.ids[s], exp.valid[s], exp.prompt_len)[:, :-1]
            loss = exp.action[s].sum() / total * algorithms.value_loss(
                values, exp.old_values[s], exp.returns[s], exp.action[s], p.value_clip)
            self.train.backward(loss)
            value_loss += loss.item()
        self.train.step(iteration)
        return CriticStats(value_loss)

    def save(self, path: str) -> str:
        """Rank 0 writes the weights (every rank calls: a partitioned model gathers)."""
        self.train.save(path, self.model, self.rank == 0, kind="critic")
        return path

    def state_dict(self) -> dict:
        """Weights, this rank's optimizer state and the torch RNG (after ``begin_step3``)."""
        return {"train": self.train.state_dict(), **rng_state(self.device)}

    def load_state_dict(self, state: dict, where: str) -> None:
        self.train.load_state_dict(state["train"], where)
        set_rng_state(state, self.device)

    def load(self, path: str) -> None:
        self.train.load(path, self.model)


def last_real(valid_BS: torch.Tensor) -> torch.Tensor:
    """Index of the last real token of each (left-padded, possibly right-padded) row."""
    return algorithms.last_index(valid_BS)
