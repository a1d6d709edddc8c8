"""A decode step of fixed shapes over the engine's slots, for torch.compile and CUDA graphs.

On a GPU, an eager decode step is launch-bound: a Python loop over layers issuing ~40 kernels a
block, a cache that changes shape, the logits copied to the host and sampled there. This step
is the same computation with nothing that varies between steps but the numbers in its buffers:

- the batch is padded to a bucket (1, 2, 4, ... up to the engine's slots): the padding rows are
  free slots, which write their own next column and keep their length (``RowCache``'s count of
  0), so one traced graph serves every batch of a bucket, across joins and leaves;
- the KV cache is the engine's slots preallocated to the model's context (``Slots`` never
  grows, so its storage, like every input buffer here, keeps its address: what a captured graph
  reads), and attention runs over all the columns, each row masked at its own length;
- the inputs (each row's last token, sampling parameters, seed and position) are copied into
  persistent buffers, and the next tokens drawn on the device (``sampling.draw_rows``: counter-
  based, from each row's seed and position); only the tokens, their log-probabilities and
  whether each row was finite come back to the host.

``StaticDecode(model, slots, compile=...)`` wraps the step in ``torch.compile`` (``"reduce-
overhead"`` captures a CUDA graph per bucket; a backend name such as ``"eager"`` traces without
compiling, as the tests do on the CPU; None runs it as it is). Prefill stays eager (its shapes
are the prompts'). RL weight updates write into the parameters' storage in place (optimizer
steps, ``load_state_dict``), which the captured graphs read: no recapture. A model whose
weights are replaced by new tensors (quantized again, adapters added) needs a new step.
"""

from __future__ import annotations

import torch

from troupe.generation.sampling import as_int64, draw_rows, finite_rows
from troupe.generation.slots import Slots
from troupe.models import RowCache

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def bucket(n: int, rows: int) -> int:
    """The smallest bucket that holds ``n`` rows (``rows``, all the slots, past the last)."""
    return next((b for b in BUCKETS if b >= n and b <= rows), rows)


class StaticDecode:
    """The decode step over ``slots`` (made with every row and column: ``Slots(cfg, R, R,
    context, ...)``) for ``model``; ``__call__`` runs it for the first B slots."""

    def __init__(self, model, slots: Slots, compile: str | None = None):
        if slots.columns != slots.context:
            raise ValueError("a static step needs the slots preallocated to the model's "
                             f"context ({slots.context} columns, not {slots.columns})")
        self.model, self.slots = model, slots
        R, device = slots.rows, slots.device
        self.tokens = torch.zeros(R, dtype=torch.long, device=device)
        self.counts = torch.zeros(R, dtype=torch.long, device=device)
        self.temperature = torch.zeros(R, device=device)
        self.top_k = torch.zeros(R, dtype=torch.long, device=device)
        self.top_p = torch.ones(R, device=device)
        self.seeds = torch.zeros(R, dtype=torch.long, device=device)
        self.positions = torch.zeros(R, dtype=torch.long, device=device)
        if compile is None:
            self._step = self._run
        elif compile in ("default", "reduce-overhead", "max-autotune"):
            self._step = torch.compile(self._run, mode=compile, dynamic=False)
        else:  # a backend: "eager", "aot_eager", "inductor", or a callable
            self._step = torch.compile(self._run, backend=compile, dynamic=False)

    @classmethod
    def of(cls, model, max_batch: int, static: "bool | StaticDecode", compile: str | None,
           static_len: int | None) -> "StaticDecode | None":
        """An engine's step (troupe.generation.engine: its ``static`` argument): None for
        False, an earlier engine's step reused (its slots freed, its graphs kept), or a new
        one over slots for every row a bucket of ``max_batch`` may pad to and ``static_len``
        columns (the model's context by default)."""
        if isinstance(static, StaticDecode):
            if static.slots.rows < max_batch or static.model is not model:
                raise ValueError("static: a step of another model or fewer slots")
            static.slots.clear(zero=False)
            return static
        if not static:
            return None
        rows, cfg = bucket(max_batch, 1 << 30), model.cfg
        slots = Slots(cfg, rows, rows, static_len or cfg.seq_len, model.device, model.dtype,
                      context=static_len, kv_heads=model.cache_heads)
        return cls(model, slots, compile)

    def __call__(self, rows: list[tuple[int, float, int, float, int, int]]
                 ) -> tuple[list[int], list[float], list[bool]]:
        """One token for each of the first len(rows) slots; ``rows``: each one's (last token,
        temperature, top_k, top_p, seed (64 bits), output position). Returns the tokens,
        their log-probabilities under the model's distribution and whether each row was
        finite."""
        rows = [(*r[:4], as_int64(r[4]), r[5]) for r in rows]
        B = len(rows)
        size = bucket(B, self.slots.rows)
        pad = [(0, 0.0, 0, 1.0, 0, 0)] * (size - B)
        columns = list(zip(*(rows + pad)))
        for buffer, values in zip((self.tokens, self.temperature, self.top_k, self.top_p,
                                   self.seeds, self.positions), columns):
            buffer[:size].copy_(torch.tensor(values, dtype=buffer.dtype),  # host: copied in
                                non_blocking=True)
        self.counts[:size].copy_(torch.tensor([1] * B + [0] * (size - B)),  # host: (as above)
                                 non_blocking=True)
        tokens, logp, finite = self._step(size)
        for i in range(B):
            self.slots.host[i] += 1
        return tokens[:B].tolist(), logp[:B].tolist(), finite[:B].tolist()

    def _run(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The traced step for a bucket of ``size`` rows (a Python int: one graph a size)."""
        s = self.slots
        cache = RowCache([k[:size] for k in s.k], [v[:size] for v in s.v], s.lengths[:size],
                         s.columns, self.counts[:size])
        h, _ = self.model.hidden(self.tokens[:size, None], cache=cache)
        logits = self.model.logits(h[:, -1]).float()
        finite = finite_rows(logits)
        tokens = draw_rows(torch.nan_to_num(logits), self.temperature[:size], self.top_k[:size],
                           self.top_p[:size], self.seeds[:size], self.positions[:size])
        logp = torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
        return tokens, logp, finite
