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

from troupe.data import ByteTokenizer
from troupe.models import GPT, GPTConfig, KVCache


class Tokenizer(Protocol):
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokens:
    """troupe's byte tokenizer with the end-of-text id doubling as padding."""

    def __init__(self) -> None:
        self._tok = ByteTokenizer()
        self.eos_id = self.pad_id = ByteTokenizer.eos_id
        self.vocab_size = ByteTokenizer.vocab_size

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).tolist()

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


class HFTokens:
    """A Hugging Face tokenizer loaded from the model's directory."""

    def __init__(self, path: str | Path):
        from transformers import AutoTokenizer
        self._tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        if self._tok.eos_token_id is None:
            raise ValueError(f"tokenizer in {path} has no eos token")
        self.eos_id = self._tok.eos_token_id
        self.pad_id = self._tok.pad_token_id if self._tok.pad_token_id is not None else self.eos_id
        self.vocab_size = len(self._tok)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


class CausalLM(nn.Module):
    """The interface: logits and hidden states of left-padded sequences, and sampling."""

    hidden_size: int
    max_len: int

    def logits(self, ids_BS: torch.Tensor, valid_BS: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def hidden(self, ids_BS: torch.Tensor, valid_BS: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def generate(self, ids_BP: torch.Tensor, valid_BP: torch.Tensor, max_new: int,
                 eos_id: int, temperature: float = 1.0, use_cache: bool = True,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Sampled continuations (B, max_new); after a sequence's eos, eos again."""
        raise NotImplementedError


class GPTLM(CausalLM):
    """troupe's GPT; generation runs with a KV cache (or, use_cache=False, by recomputing the
    whole sequence for every token: the baseline of benchmarks/generation.py)."""

    def __init__(self, cfg: GPTConfig, seed: int = 0):
        super().__init__()
        self.gpt = GPT(cfg, seed=seed)
        self.hidden_size, self.max_len = cfg.d_model, cfg.seq_len

    def logits(self, ids_BS, valid_BS):
        return self.gpt(ids_BS, valid_BS=valid_BS)[0]

    def hidden(self, ids_BS, valid_BS):
        return self.gpt.hidden(ids_BS, valid_BS=valid_BS)[0]

    @torch.inference_mode()
    def generate(self, ids_BP, valid_BP, max_new, eos_id, temperature=1.0, use_cache=True,
                 generator=None):
        B, P = ids_BP.shape
        if P + max_new > self.max_len:
            raise ValueError(f"prompt of {P} + {max_new} new tokens exceeds seq_len={self.max_len}")
        seq, valid = ids_BP, valid_BP
        cache = KVCache.empty(self.gpt.cfg, B, P + max_new, ids_BP.device) if use_cache else None
        logits = self._last_logits(ids_BP, valid_BP, cache)
        done = torch.zeros(B, dtype=torch.bool, device=ids_BP.device)
        out = []
        for i in range(max_new):
            nxt = sample(logits, temperature, generator)
            nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
            out.append(nxt)
            done |= nxt == eos_id
            if done.all() or i == max_new - 1:
                break
            seq = torch.cat([seq, nxt[:, None]], 1)
            valid = torch.cat([valid, torch.ones_like(nxt[:, None], dtype=torch.bool)], 1)
            if cache is not None:
                logits = self._last_logits(nxt[:, None], valid, cache)
            else:
                logits = self._last_logits(seq, valid, None)
        res = torch.stack(out, 1)
        pad = torch.full((B, max_new - res.shape[1]), eos_id, dtype=res.dtype, device=res.device)
        return torch.cat([res, pad], 1)


    def _last_logits(self, ids, valid, cache):
        """Next-token logits after the last position only (B, V)."""
        h = self.gpt.hidden(ids, valid_BS=valid, cache=cache)[0][:, -1]
        return F.linear(h, self.gpt.tok_emb.weight)


class HFLM(CausalLM):
    """A Hugging Face causal LM from a local directory (no hub access)."""

    def __init__(self, path: str | Path):
        super().__init__()
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True,
                                                          torch_dtype=torch.float32)
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
    def generate(self, ids_BP, valid_BP, max_new, eos_id, temperature=1.0, use_cache=True,
                 generator=None):
        if generator is not None:
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=generator)))
        out = self.model.generate(input_ids=ids_BP, attention_mask=valid_BP.long(),
                                  max_new_tokens=max_new, do_sample=True,
                                  temperature=temperature, top_k=0, use_cache=use_cache,
                                  pad_token_id=eos_id, eos_token_id=eos_id)
        res = out[:, ids_BP.shape[1]:]
        pad = torch.full((res.shape[0], max_new - res.shape[1]), eos_id, dtype=res.dtype)
        return torch.cat([res, pad], 1)


def sample(logits_BV: torch.Tensor, temperature: float,
           generator: torch.Generator | None) -> torch.Tensor:
    if temperature <= 0:
        return logits_BV.argmax(-1)
    probs = F.softmax(logits_BV.float() / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


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
