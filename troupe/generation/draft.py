"""A draft model as speculative decoding's proposer (troupe.generation.speculative).

A smaller model that shares the target's tokenizer (a smaller Hugging Face model of the same
family, or a student from apps/compress.py) proposes each sequence's next k tokens greedily;
the target verifies them in one pass as it does prompt lookup's. The draft keeps slots of its
own (troupe.generation.slots), one per sequence, in the engine's order (the engine gives both
the same ``keep`` when sequences leave). Before proposing, each row catches up on the context
its slot has not run (a newcomer's whole prompt, the tokens accepted since), all rows in one
right-padded pass, then k - 1 single-token steps. After the verify, a row keeps what the
target accepted of its proposals (``rolled_back``): the draft ran its proposals but the last.
"""

from __future__ import annotations

from itertools import accumulate

import torch

from troupe.generation.decode_layers import DecodeLayers
from troupe.generation.slots import Slots, right_padded
from troupe.kernels.small_gemm import MAX_ROWS, DecodeWeights


class DraftModel:
    """Greedy proposals from ``model`` for up to ``max_batch`` sequences. Its single-token
    steps run as the engine's do, in one native call where the model allows
    (troupe.generation.decode_layers: a draft step must cost a fraction of the target's)."""

    def __init__(self, model, max_batch: int):
        self.model, self.max_batch = model.eval(), max_batch
        self.slots: Slots | None = None
        cpu = self.model.device.type == "cpu"
        self.fused = DecodeLayers.of(self.model, DecodeWeights(self.model)) if cpu else None
        if self.fused is not None and not self.fused.has_logits:
            self.fused = None

    @torch.no_grad()
    def propose(self, contexts: list[list[int]], want: list[int]) -> list[list[int]]:
        """For row b (slot b) with context ``contexts[b]`` (the tokens so far, the last not yet
        run by the target), up to ``want[b]`` proposed tokens (0: none for that row, which
        still catches up)."""
        B, k = len(contexts), max(want)
        if k <= 0:
            return [[] for _ in contexts]
        cfg, device = self.model.cfg, self.model.device
        if self.slots is None:
            self.slots = Slots(cfg, self.max_batch, B, max(map(len, contexts)) + k + 16,
                               device, self.model.dtype, kv_heads=self.model.cache_heads)
        # what each slot has not run: at least the context's last token, which the target
        # has not run either (``rolled_back`` keeps a slot within the target's)
        todo = [c[self.slots.host[b]:] for b, c in enumerate(contexts)]
        token = self._catch_up(todo, device)
        out = [[t] for t in token.tolist()]
        for _ in range(k - 1):
            token = self._step(token, B)
            for row, t in zip(out, token.tolist()):
                row.append(t)
        return [row[:n] for row, n in zip(out, want)]

    def _catch_up(self, todo: list[list[int]], device) -> torch.Tensor:
        """Run each row's ``todo`` tokens after its slot's; each row's greedy next token."""
        B, counts = len(todo), [len(t) for t in todo]
        slots = self.slots
        if self.fused is not None and sum(counts) <= MAX_ROWS and slots.dtype == torch.float32:
            rows = [b for b, n in enumerate(counts) for _ in range(n)]
            cols = [slots.host[b] + t for b, n in enumerate(counts) for t in range(n)]
            slots.reserve(B, max(cols) + 1)
            _, greedy, _ = self.fused.tokens(
                torch.tensor([t for row in todo for t in row], device=device),
                torch.tensor(rows, device=device), torch.tensor(cols, device=device),
                slots.k, slots.v, max(cols) + 1)
            for b, n in enumerate(counts):
                slots.set_length(b, slots.host[b] + n)
            return torch.tensor([greedy[end - 1] for end in accumulate(counts)], device=device)
        idx, counts = right_padded(todo, 0)
        h, _ = self.model.hidden(idx.to(device), cache=slots.view(0, B, idx.shape[1], counts))
        last = torch.tensor(counts, device=device) - 1
        return self.model.logits(h[torch.arange(B, device=device), last]).argmax(-1)

    def _step(self, token: torch.Tensor, B: int) -> torch.Tensor:
        """Each row's next greedy token after ``token`` (B,)."""
        cache = self.slots.view(0, B, 1)
        if self.fused is not None and B <= MAX_ROWS and self.slots.dtype == torch.float32:
            _, greedy, _ = self.fused.logits(token[:, None], None, cache)
            return torch.tensor(greedy, device=token.device)
        h, _ = self.model.hidden(token[:, None], cache=cache)
        return self.model.logits(h[:, -1]).argmax(-1)

    def rolled_back(self, row: int, kept: int) -> None:
        """Row ``row``'s slot after the verify: its context is the target's ``kept`` run
        tokens and what follows them; the draft's own ran past them are dropped."""
        if self.slots is not None and self.slots.host[row] > kept:
            self.slots.set_length(row, kept)

    def keep(self, live: list[int]) -> None:
        """The engine's sequences ``live`` stay (troupe.generation.slots.Slots.keep)."""
        if self.slots is not None:
            self.slots.keep(live)

    def clear(self) -> None:
        if self.slots is not None:
            self.slots.clear()
