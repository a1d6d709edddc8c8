"""Causal language models as the RLHF roles use them: troupe's GPT or a Hugging Face model
loaded from a local directory, behind one small interface, plus the value head that turns
either into a critic or reward model.

Sequences are left-padded: ``valid_BS`` marks real tokens, and positions count real tokens only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from troupe.data import ByteTokenizer, ByteTokens, HFTokens, Tokenizer  # noqa: F401
from troupe.generation import ContinuousBatcher, SamplingParams
from troupe.models import GPT, GPTConfig
from troupe.rlhf.batch import left_pad


class CausalLM(nn.Module):
    """The interface: logits and hidden states of left-padded sequences, and sampling."""

    hidden_size: int
    max_len: int

    def logits(self, ids_BS: torch.Tensor, valid_BS: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def hidden(self, ids_BS: torch.Tensor, valid_BS: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def generate(self, prompts: list[list[int]], params: list[SamplingParams],
                 eos_id: int) -> list[list[int]]:
        """Each prompt's sampled continuation (its eos included when it ends on one)."""
        raise NotImplementedError


class GPTLM(CausalLM):
    """troupe's GPT; generation runs on troupe.generation's continuous batcher."""

    def __init__(self, cfg: GPTConfig, seed: int = 0):
        super().__init__()
        self.gpt = GPT(cfg, seed=seed)
        self.hidden_size, self.max_len = cfg.d_model, cfg.seq_len

    def logits(self, ids_BS, valid_BS):
        return self.gpt(ids_BS, valid_BS=valid_BS)[0]

    def hidden(self, ids_BS, valid_BS):
        return self.gpt.hidden(ids_BS, valid_BS=valid_BS)[0]

    @torch.inference_mode()
    def generate(self, prompts, params, eos_id):
        """Through troupe.generation's engine, all prompts in one batch: the server's engine
        and sampler, so a prompt, seed and sampling parameters give the server's tokens."""
        engine = ContinuousBatcher(self.gpt, eos_id, max_batch=max(len(prompts), 1))
        for i, (ids, p) in enumerate(zip(prompts, params)):
            engine.add(str(i), ids, p)
        out = engine.run()
        return [out.get(str(i), []) for i in range(len(prompts))]


class HFLM(CausalLM):
    """A Hugging Face causal LM from a local directory (no hub access)."""

    def __init__(self, path: str | Path):
        super().__init__()
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True,
                                                          dtype=torch.float32)
        cfg = self.model.config
        self.hidden_size = cfg.hidden_size
        self.max_len = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions")

    def _kw(self, valid_BS):
        return dict(attention_mask=valid_BS.long(),
                    position_ids=(valid_BS.long().cumsum(1) - 1).clamp_min(0))

    def logits(self, ids_BS, valid_BS):
        return self.model(input_ids=ids_BS, **self._kw(valid_BS)).logits

    def hidden(self, ids_BS, valid_BS):
        out = self.model(input_ids=ids_BS, output_hidden_states=True, **self._kw(valid_BS))
        return out.hidden_states[-1]

    @torch.no_grad()
    def generate(self, prompts, params, eos_id):
        """transformers' sampler (until issue 13 brings HF checkpoints into troupe's model and
        its engine): one batch, seeded from the first sequence's seed, temperature and top-p
        of the first sequence."""
        ids_BP, valid_BP = left_pad(prompts, eos_id)
        p, max_new = params[0], max(q.max_tokens for q in params)
        if p.seed is not None:
            torch.manual_seed(p.seed)
        sampled = p.temperature > 0
        out = self.model.generate(input_ids=ids_BP, attention_mask=valid_BP.long(),
                                  max_new_tokens=max_new, do_sample=sampled,
                                  temperature=p.temperature if sampled else None,
                                  top_p=p.top_p if sampled else None, top_k=0,
                                  pad_token_id=eos_id, eos_token_id=eos_id)
        res = out[:, ids_BP.shape[1]:].tolist()
        return [r[:r.index(eos_id) + 1] if eos_id in r else r for r in res]


class ValueModel(nn.Module):
    """A language model body with a scalar head: one value per position (critic, reward)."""

    def __init__(self, lm: CausalLM):
        super().__init__()
        self.lm = lm
        self.head = nn.Linear(lm.hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, ids_BS: torch.Tensor, valid_BS: torch.Tensor) -> torch.Tensor:
        return self.head(self.lm.hidden(ids_BS, valid_BS)).squeeze(-1)  # (B, S)


def token_logprobs(logits_BSV: torch.Tensor, ids_BS: torch.Tensor) -> torch.Tensor:
    """log p(ids[:, t+1] | ids[:, :t+1]) for t < S-1: shape (B, S-1)."""
    logp = F.log_softmax(logits_BSV[:, :-1].float(), dim=-1)
    return logp.gather(-1, ids_BS[:, 1:, None]).squeeze(-1)
