"""The reference role: the frozen SFT policy, whose log-probabilities carry the KL penalty of
step 3 and DPO's reference terms; optionally in W8A8 (``step3.quantize_frozen``)."""

from __future__ import annotations

import contextlib

import torch

from troupe.collectives import Communicator
from troupe.compression import quantize_model
from troupe.compression.quantize import outlier_channels
from troupe.data import micro_batches
from troupe.devices import worker_device
from troupe.parallel.tensor import load_shards
from troupe.rlhf.config import RLHFConfig
from troupe.rlhf.models.build import build_lm, build_trainable
from troupe.rlhf.roles.policy import action_logprobs, pair_logprobs


def quantize_frozen(gpt: torch.nn.Module, ids: torch.Tensor) -> None:
    """A frozen role's model in W8A8 (step3.quantize_frozen), at its first scoring call: each
    layer keeps 1 in 36 of its input channels in fp32 (16 for SmolLM2's 576), those with the
    largest activations on this first batch of rollouts (prompts and responses: the data the
    role will score), which is what keeps a real LLM's INT8 error small
    (troupe.compression.quantize)."""
    with torch.no_grad():
        outliers = outlier_channels(gpt, [ids], max(1, gpt.cfg.d_model // 36))
    quantize_model(gpt, {"*": "w8a8"}, outliers=outliers)


class Reference:
    """The frozen SFT policy, for the KL penalty (and DPO's reference log-probabilities: only
    then does it tokenize text)."""

    def __init__(self, cfg: RLHFConfig, rank: int, group: Communicator | None = None,
                 tp: Communicator | None = None):
        """``group``: with zero_stage 2 or 3, the ranks the frozen weights are partitioned over
        (its own role's, or the policy's when it lives in the policy's processes); ``tp``:
        the tensor-parallel group its model is split over."""
        self.device = worker_device(cfg.device)
        self.lm, self.tok = build_lm(cfg.model, cfg.seed, cfg.precision,
                                     tokenizer=not cfg.algo().online,  # DPO's pairs are text
                                     device=self.device, tools=cfg.env.tools, tp=tp)
        self.parts = None
        if cfg.zero_stage != 1 and group is not None:
            self.parts = build_trainable(self.lm, self.lm.gpt.blocks, group, cfg, self.device)
            self.parts.release()
        self.lm.requires_grad_(False)
        self.micro = cfg.step3.micro_batch_size
        self.dpo_micro = cfg.dpo.micro_batch_size
        self.quantize, self.to_quantize = cfg.step3.quantize_frozen, False

    def load(self, path: str) -> None:
        with self.parts.writable() if self.parts is not None else contextlib.nullcontext():
            load_shards(path, self.lm)
        self.to_quantize = self.quantize == "w8a8"  # at the first scoring call

    def logprobs(self, ids: torch.Tensor, valid: torch.Tensor, action: torch.Tensor,
                 prompt_len: int = 0) -> torch.Tensor:
        if self.to_quantize:
            quantize_frozen(self.lm.gpt, ids)
            self.to_quantize = False
        out = action_logprobs(self.lm, ids, valid, action, self.micro, prompt_len)
        if self.parts is not None:
            self.parts.settle()
        return out

    @torch.no_grad()
    def pair_logprobs(self, pairs: list) -> torch.Tensor:
        """(B, 2): the summed log-probabilities of each pair's chosen and rejected response."""
        self.lm.eval()
        out = [torch.stack(pair_logprobs(self.lm, self.tok, pairs[s])[:2], 1)
               for s in micro_batches(len(pairs), self.dpo_micro)]
        return torch.cat(out) if out else torch.zeros(0, 2, device=self.device)
