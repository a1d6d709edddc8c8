"""The 1-bit optimizers: OneBitAdam, ZeroOneAdam and OneBitLamb, communicating through
compressed_allreduce, with their state whole on every rank (as in DeepSpeed) or, with
``shard_state``, partitioned the way the compression already partitions the work (what that
means, and what stays whole and why: troupe.optim.onebit_base, which holds the state
handling all three share; this module holds each one's arithmetic).
"""

from __future__ import annotations

import torch

from troupe.collectives import Communicator
from troupe.kernels.onebit import adam_apply_
from troupe.optim.flat import FlatParams
from troupe.optim.onebit_base import CompressedOptimizer
from troupe.optim.sharded import trust_ratio


class OneBitAdam(CompressedOptimizer):
    """1-bit Adam. Steps 1..freeze_step: Adam on the mean gradient (without bias correction,
    as in DeepSpeed, unless ``bias_correction``: then the frozen variance keeps the correction
    of its last update, which matters when freeze_step is short of 1/(1 - beta2) steps).
    Afterwards the variance is frozen; the momentum is updated from the local gradient and
    averaged by compressed_allreduce with error feedback (and kept packed: it is 1-bit).
    ``shard_state``: this rank keeps the variance of its chunks only (see the module).

    Example::

        flat = FlatParams(model.parameters())
        opt = OneBitAdam(flat, collectives.get_group("dp"), freeze_step=400)
        loss.backward(); opt.step(lr=1e-3); flat.zero_grad()
    """

    def __init__(self, flat: FlatParams, group: Communicator | None = None, *,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, freeze_step: int = 100_000,
                 bias_correction: bool = False, grad_scale: float = 1.0,
                 shard_state: bool = False):
        super().__init__(flat, group, grad_scale, shard_state)
        self.betas, self.eps, self.wd, self.freeze_step = betas, eps, weight_decay, freeze_step
        self.bias_correction = bias_correction
        self.v = self._zeros_rows()
        self.m: torch.Tensor | None = self._zeros_rows()  # fp32 until the momentum is packed
        self._init_onebit("m")

    def state_tensors(self) -> dict[str, torch.Tensor]:
        m = {"m": self.m} if self.m is not None else self._packed_state()
        return {**m, "v": self.v}

    def step(self, lr: float) -> None:
        self.t += 1
        b1, b2 = self.betas
        if self.t <= self.freeze_step:
            g = self._mean_grad_rows()
            self.m.mul_(b1).add_(g, alpha=1 - b1)
            self.v.mul_(b2).addcmul_(g, g, value=1 - b2)
            m = self.m
        elif self.world == 1:
            m = self.m.mul_(b1).add_(self.layout.gather(self._local_grad(), [0]), alpha=1 - b1)
        else:
            self._compress_momentum(b1, self._local_grad())
            m = None  # packed: read in place by the update
        bc1, bc2 = _corrections(self.bias_correction, self.betas, self.t,
                                min(self.t, self.freeze_step))
        if m is None:
            self._update_from_packed(lr, bc1, bc2)
        else:
            p = self._params()
            _adam_update(p, m, self.v, self.eps, self.wd, lr, bc1, bc2)
            self._publish(p)

    def _update_from_packed(self, lr: float, bc1: float, bc2: float) -> None:
        """_adam_update with the momentum read packed, chunk by chunk (kernels.onebit.
        adam_apply_: one pass, nothing unpacked), into the flat parameters themselves when
        this rank keeps every row."""
        scales = self.m_scales.tolist()  # (W, T), on the host: one copy, not one per chunk
        decay = 1 - lr * self.wd if self.wd else 1.0
        p_RS = self._params() if self.sharded else None
        for i, j in enumerate(self.rows):
            for k, at, pos, n in self.layout.pieces(j):
                if n:
                    p = self.flat.data[at:at + n] if p_RS is None else p_RS[i, pos:pos + n]
                    adam_apply_(p, self.v[i, pos:pos + n], self.m_signs[j, pos // 8:],
                                lr / bc1 * scales[j][k], decay, 1 / bc2, self.eps)
        if p_RS is not None:
            self._publish(p_RS)


class ZeroOneAdam(CompressedOptimizer):
    """0/1 Adam. Until var_freeze_step the variance is updated only at steps t with
    t % interval == 0, from the full-precision gradient mean; the interval starts at 1 and doubles
    every var_update_scaler variance updates; at the other steps the momentum is updated from
    the local gradient and averaged 1-bit compressed (compressing the smooth momentum rather
    than the raw gradient, as 1-bit Adam does).
    After var_freeze_step the variance is frozen and ranks take local steps, accumulating their
    updates; every local interval (1, doubling every local_step_scaler steps, at most
    local_step_clipper) the accumulated update is averaged by compressed_allreduce and replaces
    the local ones, and the momentum is re-derived from it.

    ``update_clip`` (Adafactor's update clipping): every step scales each tensor's update
    m / (sqrt(v) + eps) down to an RMS of at most update_clip (in units of the learning rate).
    0/1 Adam refreshes its variance at ever rarer steps, then freezes it, and its momentum is
    1-bit: a tensor whose gradients grew since its variance was last refreshed, or whose
    elements have tiny variances but get the tensor's compressed magnitude, takes steps tens
    of times Adam's; in benchmarks/optimizers.py that stalled training on 2 of 3 seeds
    (benchmarks/RESULTS.md). 0 turns the clipping off: DeepSpeed's 0/1 Adam.

    ``shard_state`` shards the variance until var_freeze_step; the local steps after it need
    it whole on every rank (see the module). The momentum's error feedback is freed there (only
    the accumulated update is compressed afterwards), and acc/anchor exist from there on."""

    def __init__(self, flat: FlatParams, group: Communicator | None = None, *,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, var_freeze_step: int = 100_000,
                 var_update_scaler: int = 16, local_step_scaler: int = 32_678,
                 local_step_clipper: int = 16, update_clip: float = 1.0,
                 bias_correction: bool = False, grad_scale: float = 1.0,
                 shard_state: bool = False):
        super().__init__(flat, group, grad_scale, shard_state)
        self.betas, self.eps, self.wd = betas, eps, weight_decay
        self.bias_correction, self.update_clip = bias_correction, update_clip
        self.numels = torch.tensor([float(n) for _, n in flat.segments], device=flat.device)
        self.var_freeze_step, self.var_update_scaler = var_freeze_step, var_update_scaler
        self.local_step_scaler, self.local_step_clipper = local_step_scaler, local_step_clipper
        self.m = torch.zeros(flat.numel, device=flat.device)
        self.v = self._zeros_rows()  # rows until var_freeze_step, then whole (flat)
        self.acc: torch.Tensor | None = None
        self.anchor: torch.Tensor | None = None
        self._init_onebit("m", "acc")
        self.sched = dict(var_interval=1, var_counter=0, var_updates=0, local_interval=1,
                          local_counter=0, lrs=0.0)
        if var_freeze_step == 0:
            self._enter_local_phase()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        local = {"acc": self.acc, "anchor": self.anchor} if self.acc is not None else {}
        return {"m": self.m, "v": self.v, **local}

    def _prepare(self, t: int) -> None:
        if t >= self.var_freeze_step and self.acc is None:
            n, dev = self.flat.numel, self.flat.device
            self.v, self.acc, self.anchor = (torch.zeros(n, device=dev) for _ in range(3))
        elif t < self.var_freeze_step and self.acc is not None:
            self.v, self.acc, self.anchor = self._zeros_rows(), None, None

    def _extra_state(self) -> dict:
        return dict(self.sched)

    def _load_extra_state(self, extra: dict) -> None:
        self.sched.update({k: extra[k] for k in self.sched})

    def step(self, lr: float) -> None:
        self.t += 1
        b1, b2 = self.betas
        s = self.sched
        if self.t <= self.var_freeze_step:
            if self.t % s["var_interval"] == 0:  # a variance step: the exact gradient mean
                g = self._allreduce_mean(self.flat.grad[:self.flat.numel].clone())
                g_rows = self.layout.gather(g, self.rows)
                self.v.mul_(b2).addcmul_(g_rows, g_rows, value=1 - b2)
                self.m.mul_(b1).add_(g, alpha=1 - b1)
                s["var_counter"] += 1
                s["var_updates"] += 1
                if s["var_counter"] == self.var_update_scaler:
                    s["var_counter"], s["var_interval"] = 0, s["var_interval"] * 2
            else:  # otherwise the momentum travels 1-bit compressed, as in 1-bit Adam
                self.m.mul_(b1).add_(self._local_grad(), alpha=1 - b1)
                self._onebit_mean(self.m, "m")
            p = self._params()
            _adam_update(p, self.layout.gather(self.m, self.rows), self.v, self.eps, self.wd,
                         lr, *self._bc(), clip=self._clipper(self._clip_rows))
            self._publish(p)
            if self.t == self.var_freeze_step:
                self._enter_local_phase()
            return
        p = self.flat.data[:self.flat.numel]
        self.m.mul_(b1).add_(self._local_grad(), alpha=1 - b1)
        before = p.clone()
        _adam_update(p, self.m, self.v, self.eps, self.wd, lr, *self._bc(),
                     clip=self._clipper(self._clip_flat))
        self.acc.add_(before.sub_(p))
        s["lrs"] += lr
        s["local_counter"] += 1
        if s["local_counter"] >= s["local_interval"]:
            self._sync()
        if (self.t - self.var_freeze_step) % self.local_step_scaler == 0:
            s["local_interval"] = min(2 * s["local_interval"], self.local_step_clipper)

    def _enter_local_phase(self) -> None:
        """The variance whole and in flat order (the local steps use all of it), the anchor of
        the local steps, their accumulator; the momentum's error feedback is not used again."""
        n, dev = self.flat.numel, self.flat.device
        v = torch.zeros(n, device=dev)
        self.layout.scatter(self._whole(self.v), self.all_rows, v)
        self.v, self.acc = v, torch.zeros(n, device=dev)
        self.anchor = self.flat.data[:n].clone()
        for state in self.onebit["m"]:
            state.reset()

    def _bc(self) -> tuple[float, float]:
        return _corrections(self.bias_correction, self.betas, self.t, self.sched["var_updates"])

    def _clipper(self, clip):
        """``clip`` (one of the two below) when update_clip is on, else None."""
        return clip if self.update_clip else None

    def _over_clip(self, sums_T: torch.Tensor) -> torch.Tensor:
        """(T,): what each tensor's update is divided by (at least 1), from its sum of
        squares."""
        return sums_T.div_(self.numels).sqrt_().div_(self.update_clip).clamp_min_(1.0)

    def _clip_rows(self, u_RS: torch.Tensor) -> None:
        """Clip an update held as this rank's rows (a tensor's RMS over all ranks' rows)."""
        u_RS.div_(self._per_element(self._over_clip(self._tensor_sums(u_RS.square()))))

    def _clip_flat(self, u: torch.Tensor) -> None:
        """Clip an update held whole, in flat order."""
        segments = self.flat.segments
        over = self._over_clip(torch.stack([u[o:o + n].square().sum() for o, n in segments]))
        for k, (o, n) in enumerate(segments):
            u[o:o + n].div_(over[k])

    def _sync(self) -> None:
        s, p = self.sched, self.flat.data[:self.flat.numel]
        self._onebit_mean(self.acc, "acc")
        torch.sub(self.anchor, self.acc, out=p)  # every rank lands on the same parameters
        self.anchor.copy_(p)
        # the momentum that, with the frozen variance, gives the averaged update per unit lr
        bc1, bc2 = self._bc()
        self.m.copy_(self.acc).div_(s["lrs"]).mul_((self.v / bc2).sqrt_().add_(self.eps)).mul_(bc1)
        self.acc.zero_()
        s["lrs"], s["local_counter"] = 0.0, 0


class OneBitLamb(CompressedOptimizer):
    """1-bit LAMB. Steps 1..freeze_step: LAMB on the mean gradient, tracking an EMA
    (coeff_beta) of each tensor's trust ratio. Afterwards: the frozen ratio times a per-tensor
    factor max((sqrt(v)+eps) / (sqrt(v_fresh)+eps)), clamped to [factor_min, factor_max] and to
    within factor_threshold of its last value, where v_fresh follows the gradients reconstructed
    from the compressed momentum. Each tensor's momentum is scaled by a per-tensor coefficient
    fixed at the freeze (so that they have similar magnitudes) before compression.
    ``shard_state``: this rank keeps v and v_fresh of its chunks; the per-tensor norms and
    maxima are combined across the ranks' chunks (see the module)."""

    def __init__(self, flat: FlatParams, group: Communicator | None = None, *,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, freeze_step: int = 100_000,
                 max_coeff: float = 10.0, min_coeff: float = 0.01, coeff_beta: float = 0.9,
                 factor_max: float = 4.0, factor_min: float = 0.5, factor_threshold: float = 0.1,
                 bias_correction: bool = False, grad_scale: float = 1.0,
                 shard_state: bool = False):
        super().__init__(flat, group, grad_scale, shard_state)
        self.betas, self.eps, self.wd, self.freeze_step = betas, eps, weight_decay, freeze_step
        self.bias_correction = bias_correction
        self.max_coeff, self.min_coeff, self.coeff_beta = max_coeff, min_coeff, coeff_beta
        self.factor_max, self.factor_min = factor_max, factor_min
        self.factor_threshold = factor_threshold
        T, dev = self.layout.T, flat.device
        self.m: torch.Tensor | None = self._zeros_rows()  # fp32 until the momentum is packed
        self.v, self.v_fresh = self._zeros_rows(), self._zeros_rows()
        self.coeff_freeze = torch.zeros(T, device=dev)
        self.last_factor, self.scaling = torch.ones(T, device=dev), torch.ones(T, device=dev)
        self.m_divisor = self.scaling  # the momentum is compressed scaled (fixed at the freeze)
        self._init_onebit("m")

    def state_tensors(self) -> dict[str, torch.Tensor]:
        m = {"m": self.m} if self.m is not None else self._packed_state()
        return {**m, "v": self.v, "v_fresh": self.v_fresh, "coeff_freeze": self.coeff_freeze,
                "last_factor": self.last_factor, "scaling": self.scaling}

    def step(self, lr: float) -> None:
        self.t += 1
        b1, b2 = self.betas
        p = self._params()
        if self.t <= self.freeze_step:
            g = self._mean_grad_rows()
            self.m.mul_(b1).add_(g, alpha=1 - b1)
            self.v.mul_(b2).addcmul_(g, g, value=1 - b2)
            u = self._direction(p, *_corrections(self.bias_correction, self.betas, self.t, self.t))
            coeff = trust_ratio(self._tensor_sums(p * p).sqrt(), self._tensor_sums(u * u).sqrt(),
                                self.min_coeff, self.max_coeff)
            self.coeff_freeze.mul_(self.coeff_beta).add_(coeff, alpha=1 - self.coeff_beta)
            p.add_(u * self._per_element(coeff), alpha=-lr)
            self._publish(p)
            return
        if self.t == self.freeze_step + 1:
            self._freeze()
        m_old = self.m.clone() if self.m is not None else self._unpacked_rows()
        if self.world == 1:
            scale = self._per_element(self.scaling)
            g = self.layout.gather(self._local_grad(), [0])
            m = self.m.mul_(b1).add_(g, alpha=1 - b1).mul_(scale).div_(scale)
        else:
            self._compress_momentum(b1, self._local_grad(), self.scaling)
            m = self._unpacked_rows()
        g_rec = (m - m_old * b1).div_(1 - b1)
        self.v_fresh.mul_(b2).addcmul_(g_rec, g_rec, value=1 - b2)
        bc1, bc2 = _corrections(self.bias_correction, self.betas, self.t, self.freeze_step)
        _, bc2_fresh = _corrections(self.bias_correction, self.betas, self.t, self.t)
        denom = (self.v / bc2).sqrt_().add_(self.eps)
        u_pre = m / bc1 / denom
        u = u_pre + self.wd * p if self.wd else u_pre
        ratio = denom.div_((self.v_fresh / bc2_fresh).sqrt_().add_(self.eps))
        factor = self._tensor_maxes(ratio)
        if self.wd:
            r = (self._tensor_sums(u_pre * u_pre).sqrt() / self._tensor_sums(u * u).sqrt()
                 .clamp_min(1e-30)).clamp_(max=1.0)
            factor = factor * r + (1 - r)
        factor = factor.clamp_(self.factor_min, self.factor_max)
        factor = torch.minimum(factor, self.last_factor * (1 + self.factor_threshold))
        factor = torch.maximum(factor, self.last_factor * (1 - self.factor_threshold))
        self.last_factor.copy_(factor)
        p.add_(u * self._per_element(self.coeff_freeze * factor), alpha=-lr)
        self._publish(p)

    def _direction(self, p: torch.Tensor, bc1: float, bc2: float) -> torch.Tensor:
        u = (self.m / bc1).div_((self.v / bc2).sqrt_().add_(self.eps))
        return u.add_(p, alpha=self.wd) if self.wd else u

    def _freeze(self) -> None:
        self.v_fresh.copy_(self.v)
        counts = torch.tensor([float(n) for _, n in self.flat.segments], device=self.m.device)
        scales = self._tensor_sums(self.m * self.m).sqrt() / counts.sqrt()
        ok = scales > 0
        united = scales[ok].mean() if ok.any() else torch.tensor(1.0, device=scales.device)
        self.scaling.copy_(torch.where(ok, united / scales.clamp_min(1e-30), torch.ones_like(scales)))


def _corrections(enabled: bool, betas: tuple[float, float], m_updates: int,
                 v_updates: int) -> tuple[float, float]:
    """Adam's bias corrections 1 - beta^k for the moments' numbers of updates (1 when off)."""
    if not enabled:
        return 1.0, 1.0
    return 1 - betas[0] ** m_updates, 1 - betas[1] ** max(v_updates, 1)


def _adam_update(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, eps: float, wd: float,
                 lr: float, bc1: float = 1.0, bc2: float = 1.0, clip=None) -> None:
    """p -= lr * ((m / bc1) / (sqrt(v / bc2) + eps) + wd * p); bc1 = bc2 = 1 is Adam without
    bias correction (DeepSpeed's 1-bit Adam). ``clip`` rescales the update (the first term)
    in place before it is applied (0/1 Adam's update_clip)."""
    if wd:
        p.mul_(1 - lr * wd)
    if clip is None:
        p.addcdiv_(m, (v / bc2).sqrt_().add_(eps), value=-lr / bc1)
        return
    u = (m / bc1).div_((v / bc2).sqrt_().add_(eps))
    clip(u)
    p.sub_(u, alpha=lr)
