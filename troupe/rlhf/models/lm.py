"""The language model as the RLHF roles use it: troupe's decoder (its own GPT or a Hugging Face
checkpoint loaded into it) on left-padded sequences, generation through troupe's engine, and
the value head that turns the same body into a critic or reward model.

Sequences are left-padded: ``valid_BS`` marks real tokens, and positions count real tokens only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from troupe.data import micro_batches, token_micro_batches
from troupe.generation import ContinuousBatcher, DraftModel, SamplingParams
from troupe.generation.prefix_cache import PrefixCache
from troupe.kernels.small_gemm import DecodeWeights
from troupe.models import GPT, PrefixTree
from troupe.models.layers import vocab_parallel_logprobs
from troupe.models.packing import Packing


class GPTLM(nn.Module):
    """A GPT on left-padded sequences; generation runs on troupe.generation's engine.
    ``precision`` "bf16": every forward but generation (training, log-probabilities, values)
    runs under bf16 autocast, the weights staying fp32; log-softmax in fp32. ``packing``:
    ``hidden`` runs the rows' real tokens packed (troupe.models.packing), and with
    ``packing_tokens`` the roles' micro-batches hold that many real tokens
    (``micro_batches``). ``padding`` counts (real tokens, positions of the padded rows,
    positions computed, real tokens among them) over the training forwards (those with
    gradients) so far; a prompt shared by a group's rows (``shared_hidden``) is computed, and
    counted in the last two, once."""

    def __init__(self, gpt: GPT, precision: str = "fp32", packing: bool = False,
                 packing_tokens: int | None = None):
        super().__init__()
        self.gpt, self.precision, self.packing = gpt, precision, packing
        self.packing_tokens = packing_tokens
        self.padding = [0, 0, 0, 0]
        self.hidden_size, self.max_len = gpt.cfg.d_model, gpt.cfg.seq_len

    @property
    def device(self) -> torch.device:
        return self.gpt.tok_emb.weight.device

    def autocast(self):
        return self.gpt.mixed_precision(self.precision)

    def logits(self, ids_BS: torch.Tensor, valid_BS: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            return self.gpt(ids_BS, valid_BS=valid_BS)[0].float()

    def hidden(self, ids_BS: torch.Tensor, valid_BS: torch.Tensor) -> torch.Tensor:
        """Final hidden states (B, S, C): no vocabulary projection (the value head reads them);
        zeros at padding when packed."""
        real, (B, S) = int(valid_BS.sum()), valid_BS.shape
        if not self.packing:
            self._count(real, B * S, B * S, real)
            with self.autocast():
                return self.gpt.hidden(ids_BS, valid_BS=valid_BS)[0]
        packing = Packing.of(valid_BS)
        self._count(real, B * S, packing.segments_PT.numel(), real)
        with self.autocast():
            h = self.gpt.hidden(packing.pack(ids_BS), segments_BT=packing.segments_PT)[0]
        return packing.unpack(h)

    def micro_batches(self, valid_BS: torch.Tensor, size: int | None) -> list[slice]:
        """The row slices a role runs one at a time: ``size`` rows each, or with packing and
        ``packing_tokens``, consecutive rows of at most that many real tokens together."""
        if self.packing and self.packing_tokens:
            return token_micro_batches(valid_BS.sum(1).tolist(), self.packing_tokens)
        return micro_batches(len(valid_BS), size)

    def _count(self, real: int, padded: int, computed: int, real_computed: int) -> None:
        if torch.is_grad_enabled():  # training forwards only
            self.padding = [a + b for a, b in zip(self.padding,
                                                  (real, padded, computed, real_computed))]

    def token_logprobs(self, ids_BS: torch.Tensor, valid_BS: torch.Tensor,
                       where_BR: torch.Tensor, entropy: bool = False, prompt_len: int = 0):
        """log p(ids[:, t+1] | ids[:, :t+1]) at the positions t where ``where_BR`` (B, S-1) is
        nonzero, 0 elsewhere: the vocabulary projection and its softmax run on those positions
        only (a 49k-word vocabulary on every prompt token costs as much as a few layers).
        With ``entropy``: also the entropy of the next-token distribution there, (B, S-1).
        A tensor-parallel model's log-softmax is vocabulary-parallel (its logits never
        gathered: troupe.models.layers.vocab_parallel_logprobs).

        prompt_len: the first ``prompt_len`` columns are the prompt; consecutive rows with the
        same prompt (a group of samples) then run it once, and the opening all prompts share
        once (``shared_hidden``)."""
        h_BRC = self.shared_hidden(ids_BS, valid_BS, prompt_len)[:, :-1]
        at = where_BR.bool()
        targets_N = ids_BS[:, 1:][at]
        tp = self.gpt.tp
        with self.autocast():
            h_NC = h_BRC[at]
            logits_NV = self.gpt.logits(h_NC) if tp is None else self.gpt.logits_shard(h_NC)
        if tp is None:
            logp_NV = F.log_softmax(logits_NV.float(), dim=-1)
            logp_N = logp_NV.gather(-1, targets_N[:, None]).squeeze(-1)
            ent_N = None
            if entropy:
                with torch.no_grad():
                    ent_N = -(logp_NV.exp() * logp_NV).sum(-1)
        else:  # this rank's vocabulary columns: the logits are never gathered
            logp_N, ent_N = vocab_parallel_logprobs(logits_NV, targets_N, tp,
                                                    self.gpt.cfg.vocab_size, entropy)
        out = torch.zeros(where_BR.shape, dtype=logp_N.dtype, device=logp_N.device)
        out[at] = logp_N
        if not entropy:
            return out
        ent = torch.zeros_like(out)
        ent[at] = ent_N
        return out, ent

    def shared_hidden(self, ids_BS: torch.Tensor, valid_BS: torch.Tensor,
                      prompt_len: int) -> torch.Tensor:
        """``hidden`` of rows whose first ``prompt_len`` columns are a prompt that runs of
        consecutive rows share: each distinct prompt goes through the model once, and its
        rows' continuations attend to its keys and values (troupe.models.PrefixTree); and
        when the distinct prompts open with the same tokens (a chat template's system
        prompt, an instruction before each question), those run once for all of them. The
        same values and gradients as ``hidden`` at the real tokens; GRPO's 4-16 samples of a
        prompt cost one prompt's compute instead of 4-16. ``prompt_len`` 0: ``hidden``."""
        P, (B, S) = prompt_len, ids_BS.shape
        if not P or P >= S:
            return self.hidden(ids_BS, valid_BS)
        prompt_ids, prompt_valid = ids_BS[:, :P], valid_BS[:, :P]
        same = ((prompt_ids[1:] == prompt_ids[:-1]).all(1)
                & (prompt_valid[1:] == prompt_valid[:-1]).all(1))
        first = torch.cat([same.new_ones(1), ~same])  # (B,) a row that starts a new prompt
        rows = first.long().cumsum(0) - 1             # (B,) its prompt's index
        ids_DP, valid_DP = prompt_ids[first], prompt_valid[first]
        D, lengths = len(ids_DP), valid_DP.sum(1)     # (D,) each prompt's real tokens
        C = common_prefix(ids_DP, valid_DP) if D > 1 else 0
        computed = C + D * (P - C) + B * (S - P)
        if D == B and (C == 0 or self.packing):  # no group: packing, if on, drops more
            return self.hidden(ids_BS, valid_BS)
        if self.packing and Packing.of(valid_BS).segments_PT.numel() <= computed:
            return self.hidden(ids_BS, valid_BS)
        self._count(int(valid_BS.sum()), B * S, computed,
                    int(lengths.sum()) - (D - 1) * C + int(valid_BS[:, P:].sum()))
        device = ids_BS.device
        levels, ids = [], []
        if C:  # the opening all prompts share, then each prompt's rest, right-aligned (the
            # last lengths[d] - C columns: what is before is padding after the opening)
            start = int(P - lengths[0])
            ids.append(ids_DP[:1, start:start + C])
            levels.append((None, valid_DP.new_ones(1, C)))
            rest_DW = torch.arange(P - C, device=device) >= (P - lengths)[:, None]
            ids.append(torch.where(rest_DW, ids_DP[:, C:], 0))
            levels.append((torch.zeros(D, dtype=torch.long, device=device), rest_DW))
        else:
            ids.append(ids_DP)
            levels.append((None, valid_DP))
        ids.append(ids_BS[:, P:])
        levels.append((rows, valid_BS[:, P:]))
        tree = PrefixTree(levels)
        with self.autocast():
            h = tree.unpack(self.gpt.hidden(tree.pack(ids), cache=tree)[0])
        h_prompt = _unshare(h[0], h[1], lengths, P) if C else h[0]
        h_rest = h[-1]
        return torch.cat([h_prompt.index_select(0, rows), h_rest], 1)

    def packed_weights(self) -> DecodeWeights:
        """The weights packed for decoding, kept between calls (on huge pages: they live long)
        and refreshed in place at each (no fresh 0.5 GB a call)."""
        if getattr(self, "_packed", None) is None:
            self._packed = DecodeWeights(self.gpt, huge_pages=True)
        else:
            self._packed.refresh()
        return self._packed

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: list[SamplingParams],
                 eos_id: int, max_batch: int | None = None,
                 keep_packed: bool = False, prefix_cache_mb: float = 0,
                 decode_graphs: bool = False, speculate: int = 0, draft=None
                 ) -> tuple[list[list[int]], list[list[float]]]:
        """Each prompt's sampled continuation (its eos included when it ends on one), through
        troupe.generation's engine (``max_batch`` at once, all by default): the server's
        engine and sampler, so a prompt, seed and sampling parameters give the server's
        tokens; and, where a prompt's parameters ask for logprobs, each sampled token's
        log-probability under the engine's own distribution (else an empty list).
        ``keep_packed``: keep the weights packed for decoding between calls (refreshed in
        place each call: no fresh 0.5 GB a call, held all along). ``prefix_cache_mb``: keep
        prompts' keys and values for the call (troupe.generation.prefix_cache), so that the
        samples of a prompt admitted at different steps run it once; ``prefill_tokens`` then
        says how many prompt tokens the call ran. ``decode_graphs`` (on cuda): decode steps
        in fixed shapes captured as CUDA graphs (troupe.generation.static_step), the step and
        its cache kept between calls while they fit (the weights are updated in place).
        ``speculate``: proposals a step (troupe.generation.speculative), by prompt lookup or
        from the model ``draft`` (a GPT of the same vocabulary); ``speculation`` then counts
        its passes, proposals and acceptances."""
        packed = self.packed_weights() if keep_packed else True
        B = max(min(len(prompts), max_batch or len(prompts)), 1)
        static = decode_graphs and self.gpt.device.type == "cuda"
        longest = max((len(x) + p.max_tokens for x, p in zip(prompts, params)), default=1)
        kept = getattr(self, "_static", None)
        if static and kept is not None and kept.slots.rows >= B and kept.slots.context >= longest:
            static = kept
        engine = ContinuousBatcher(self.gpt, eos_id, max_batch=B, packed_decode=packed,
                                   prefix_cache=(PrefixCache(int(prefix_cache_mb * 2**20))
                                                 if prefix_cache_mb else None),
                                   static=static, compile="reduce-overhead",
                                   static_len=longest, speculate=speculate,
                                   draft=None if draft is None else DraftModel(draft, B))
        self._static = engine.static or kept
        for i, (ids, p) in enumerate(zip(prompts, params)):
            engine.add(str(i), ids, p)
        out, logp = engine.run_with_logprobs()
        self.prefill_tokens = engine.prefill_tokens
        self.speculation = tuple(engine.speculation.values())
        return ([out.get(str(i), []) for i in range(len(prompts))],
                [logp.get(str(i), []) for i in range(len(prompts))])


class ValueModel(nn.Module):
    """A language model body with a scalar head: one value per position (critic, reward)."""

    def __init__(self, lm: GPTLM):
        super().__init__()
        self.lm = lm
        self.head = nn.Linear(lm.hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, ids_BS: torch.Tensor, valid_BS: torch.Tensor,
                prompt_len: int = 0) -> torch.Tensor:
        """(B, S) values; ``prompt_len`` as for ``GPTLM.token_logprobs`` (shared prompts and
        openings run once)."""
        h = self.lm.shared_hidden(ids_BS, valid_BS, prompt_len)
        with self.lm.autocast():
            return self.head(h).squeeze(-1).float()


def common_prefix(ids_BP: torch.Tensor, valid_BP: torch.Tensor) -> int:
    """How many real tokens every row of left-padded prompts opens with, at most one fewer
    than the shortest prompt has (so that each keeps a token of its own)."""
    lengths = valid_BP.sum(1)
    m = int(lengths.min()) - 1
    if m <= 0:
        return 0
    P = ids_BP.shape[1]
    cols = (P - lengths)[:, None] + torch.arange(m, device=ids_BP.device)  # (B, m)
    aligned = ids_BP.gather(1, cols)
    agree = (aligned == aligned[:1]).all(0)
    return m if bool(agree.all()) else int((~agree).nonzero()[0])


def _unshare(h_common: torch.Tensor, h_rest: torch.Tensor, lengths: torch.Tensor,
             P: int) -> torch.Tensor:
    """(D, P, C) hidden states of D left-padded prompts from their shared opening's (1, Cm,
    C) and their rests' (D, P - Cm, C), each rest right-aligned: every real token back in
    its prompt's column (padding columns get a padding position's state)."""
    Cm, D = h_common.shape[1], len(h_rest)
    virtual = torch.cat([h_common.expand(D, -1, -1), h_rest], 1)  # [opening][pad][rest]
    col = torch.arange(P, device=h_rest.device)[None, :]
    pad = (P - lengths)[:, None]                                   # (D, 1)
    src = torch.where(col < pad, col + Cm, torch.where(col < pad + Cm, col - pad, col))
    return virtual.gather(1, src[:, :, None].expand(-1, -1, virtual.shape[2]))
