"""The 1-bit optimizers: OneBitAdam, ZeroOneAdam and OneBitLamb. Each keeps its state whole on
every rank (as in DeepSpeed: sharding would need an fp32 parameter all_gather per step, which is
the traffic compression removes) and communicates through compressed_allreduce."""

from __future__ import annotations

import torch

from troupe.collectives import Communicator, OneBitState, compressed_allreduce, padded_numel
from troupe.optim.base import Optimizer
from troupe.optim.flat import FlatParams
from troupe.optim.sharded import trust_ratio


class _Compressed(Optimizer):
    """Shared plumbing: the 1-bit mean of a flat buffer, compressed tensor by tensor (each
    parameter gets its own scale, as in DeepSpeed: one scale for the whole buffer would give
    small-gradient tensors the magnitude of large ones), with error-feedback states saved with
    the optimizer."""

    def _init_onebit(self, *names: str) -> None:
        self.onebit: dict[str, list[OneBitState]] = {
            name: [OneBitState() for _ in self.flat.segments] for name in names}

    def _onebit_mean(self, x: torch.Tensor, name: str) -> torch.Tensor:
        if self.world == 1:
            return x
        for (offset, n), state in zip(self.flat.segments, self.onebit[name]):
            part = x[offset:offset + n]
            part.copy_(compressed_allreduce(part, state, self.group))
            self.comm.compressed(padded_numel(n, self.world), self.world)
        return x

    def state_bytes(self) -> int:
        errors = [t for states in self.onebit.values() for st in states
                  for t in st.state_dict().values() if t is not None]
        return super().state_bytes() + sum(t.numel() * t.element_size() for t in errors)

    def state_dict(self, copy: bool = True) -> dict:
        state = super().state_dict(copy)
        state["onebit"] = {name: [{k: v.clone() if copy else v for k, v in st.state_dict().items()
                                   if v is not None} for st in states]
                           for name, states in self.onebit.items()}
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        for name, states in self.onebit.items():
            saved = state["onebit"].get(name, [])
            if len(saved) != len(states):
                raise ValueError(f"optimizer state {name!r}: error feedback for {len(saved)} "
                                 f"tensors, this model has {len(states)}")
            for st, errors in zip(states, saved):
                st.reset()
                if errors:
                    st.load_state_dict(errors)

    def _local_grad(self) -> torch.Tensor:
        g = self.flat.grad[:self.flat.numel]
        return g * self.grad_scale if self.grad_scale != 1.0 else g


class OneBitAdam(_Compressed):
    """1-bit Adam. Steps 1..freeze_step: Adam on allreduced gradients (without bias correction,
    as in DeepSpeed, unless ``bias_correction``: then the frozen variance keeps the correction
    of its last update, which matters when freeze_step is short of 1/(1 - beta2) steps).
    Afterwards the variance is frozen; the momentum is updated from the local gradient and
    averaged by compressed_allreduce with error feedback.

    Example::

        flat = FlatParams(model.parameters())
        opt = OneBitAdam(flat, collectives.get_group("dp"), freeze_step=400)
        loss.backward(); opt.step(lr=1e-3); flat.zero_grad()
    """

    def __init__(self, flat: FlatParams, group: Communicator | None = None, *,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, freeze_step: int = 100_000,
                 bias_correction: bool = False, grad_scale: float = 1.0):
        super().__init__(flat, group, grad_scale)
        self.betas, self.eps, self.wd, self.freeze_step = betas, eps, weight_decay, freeze_step
        self.bias_correction = bias_correction
        n, dev = flat.numel, flat.device
        self.m, self.v = torch.zeros(n, device=dev), torch.zeros(n, device=dev)
        self._init_onebit("m")

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"m": self.m, "v": self.v}

    def step(self, lr: float) -> None:
        self.t += 1
        b1, b2 = self.betas
        if self.t <= self.freeze_step:
            g = self._allreduce_mean(self.flat.grad[:self.flat.numel].clone())
            self.m.mul_(b1).add_(g, alpha=1 - b1)
            self.v.mul_(b2).addcmul_(g, g, value=1 - b2)
        else:
            self.m.mul_(b1).add_(self._local_grad(), alpha=1 - b1)
            self._onebit_mean(self.m, "m")
        bc1, bc2 = _corrections(self.bias_correction, self.betas, self.t,
                                min(self.t, self.freeze_step))
        _adam_update(self.flat.data[:self.flat.numel], self.m, self.v, self.eps, self.wd, lr,
                     bc1, bc2)


class ZeroOneAdam(_Compressed):
    """0/1 Adam. Until var_freeze_step the variance is updated only at steps t with
    t % interval == 0, from the full-precision gradient mean; the interval starts at 1 and doubles
    every var_update_scaler variance updates; at the other steps the momentum is updated from
    the local gradient and averaged 1-bit compressed (compressing the smooth momentum rather
    than the raw gradient, as 1-bit Adam does).
    After var_freeze_step the variance is frozen and ranks take local steps, accumulating their
    updates; every local interval (1, doubling every local_step_scaler steps, at most
    local_step_clipper) the accumulated update is averaged by compressed_allreduce and replaces
    the local ones, and the momentum is re-derived from it."""

    def __init__(self, flat: FlatParams, group: Communicator | None = None, *,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, var_freeze_step: int = 100_000,
                 var_update_scaler: int = 16, local_step_scaler: int = 32_678,
                 local_step_clipper: int = 16, bias_correction: bool = False,
                 grad_scale: float = 1.0):
        super().__init__(flat, group, grad_scale)
        self.betas, self.eps, self.wd = betas, eps, weight_decay
        self.bias_correction = bias_correction
        self.var_freeze_step, self.var_update_scaler = var_freeze_step, var_update_scaler
        self.local_step_scaler, self.local_step_clipper = local_step_scaler, local_step_clipper
        n, dev = flat.numel, flat.device
        self.m, self.v = torch.zeros(n, device=dev), torch.zeros(n, device=dev)
        self.acc, self.anchor = torch.zeros(n, device=dev), torch.zeros(n, device=dev)
        self._init_onebit("m", "acc")
        self.sched = dict(var_interval=1, var_counter=0, var_updates=0, local_interval=1,
                          local_counter=0, lrs=0.0)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"m": self.m, "v": self.v, "acc": self.acc, "anchor": self.anchor}

    def _extra_state(self) -> dict:
        return dict(self.sched)

    def _load_extra_state(self, extra: dict) -> None:
        self.sched.update({k: extra[k] for k in self.sched})

    def step(self, lr: float) -> None:
        self.t += 1
        b1, b2 = self.betas
        s, p = self.sched, self.flat.data[:self.flat.numel]
        if self.t <= self.var_freeze_step:
            if self.t % s["var_interval"] == 0:  # a variance step: the exact gradient mean
                g = self._allreduce_mean(self.flat.grad[:self.flat.numel].clone())
                self.v.mul_(b2).addcmul_(g, g, value=1 - b2)
                self.m.mul_(b1).add_(g, alpha=1 - b1)
                s["var_counter"] += 1
                s["var_updates"] += 1
                if s["var_counter"] == self.var_update_scaler:
                    s["var_counter"], s["var_interval"] = 0, s["var_interval"] * 2
            else:  # otherwise the momentum travels 1-bit compressed, as in 1-bit Adam
                self.m.mul_(b1).add_(self._local_grad(), alpha=1 - b1)
                self._onebit_mean(self.m, "m")
            _adam_update(p, self.m, self.v, self.eps, self.wd, lr, *self._bc())
            if self.t == self.var_freeze_step:
                self.anchor.copy_(p)
            return
        self.m.mul_(b1).add_(self._local_grad(), alpha=1 - b1)
        before = p.clone()
        _adam_update(p, self.m, self.v, self.eps, self.wd, lr, *self._bc())
        self.acc.add_(before.sub_(p))
        s["lrs"] += lr
        s["local_counter"] += 1
        if s["local_counter"] >= s["local_interval"]:
            self._sync()
        if (self.t - self.var_freeze_step) % self.local_step_scaler == 0:
            s["local_interval"] = min(2 * s["local_interval"], self.local_step_clipper)

    def _bc(self) -> tuple[float, float]:
        return _corrections(self.bias_correction, self.betas, self.t, self.sched["var_updates"])

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


class OneBitLamb(_Compressed):
    """1-bit LAMB. Steps 1..freeze_step: LAMB on allreduced gradients, tracking an EMA
    (coeff_beta) of each tensor's trust ratio. Afterwards: the frozen ratio times a per-tensor
    factor max((sqrt(v)+eps) / (sqrt(v_fresh)+eps)), clamped to [factor_min, factor_max] and to
    within factor_threshold of its last value, where v_fresh follows the gradients reconstructed
    from the compressed momentum. All tensors' momenta travel in one fused buffer, each scaled by
    a per-tensor coefficient fixed at the freeze so that they have similar magnitudes."""

    def __init__(self, flat: FlatParams, group: Communicator | None = None, *,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, freeze_step: int = 100_000,
                 max_coeff: float = 10.0, min_coeff: float = 0.01, coeff_beta: float = 0.9,
                 factor_max: float = 4.0, factor_min: float = 0.5, factor_threshold: float = 0.1,
                 bias_correction: bool = False, grad_scale: float = 1.0):
        super().__init__(flat, group, grad_scale)
        self.betas, self.eps, self.wd, self.freeze_step = betas, eps, weight_decay, freeze_step
        self.bias_correction = bias_correction
        self.max_coeff, self.min_coeff, self.coeff_beta = max_coeff, min_coeff, coeff_beta
        self.factor_max, self.factor_min = factor_max, factor_min
        self.factor_threshold = factor_threshold
        n, T, dev = flat.numel, len(flat.params), flat.device
        self.seg = flat.segment_ids(0, n)
        self.m, self.v, self.v_fresh = (torch.zeros(n, device=dev) for _ in range(3))
        self.coeff_freeze = torch.zeros(T, device=dev)
        self.last_factor, self.scaling = torch.ones(T, device=dev), torch.ones(T, device=dev)
        self._init_onebit("m")

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"m": self.m, "v": self.v, "v_fresh": self.v_fresh,
                "coeff_freeze": self.coeff_freeze, "last_factor": self.last_factor,
                "scaling": self.scaling}

    def _per_tensor(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(len(self.flat.params), device=x.device).index_add_(0, self.seg, x)

    def step(self, lr: float) -> None:
        self.t += 1
        b1, b2 = self.betas
        p = self.flat.data[:self.flat.numel]
        if self.t <= self.freeze_step:
            g = self._allreduce_mean(self.flat.grad[:self.flat.numel].clone())
            self.m.mul_(b1).add_(g, alpha=1 - b1)
            self.v.mul_(b2).addcmul_(g, g, value=1 - b2)
            u = self._direction(p, *_corrections(self.bias_correction, self.betas, self.t, self.t))
            coeff = trust_ratio(self._per_tensor(p * p).sqrt(), self._per_tensor(u * u).sqrt(),
                                self.min_coeff, self.max_coeff)
            self.coeff_freeze.mul_(self.coeff_beta).add_(coeff, alpha=1 - self.coeff_beta)
            p.add_(u * coeff[self.seg], alpha=-lr)
            return
        if self.t == self.freeze_step + 1:
            self._freeze()
        m_old = self.m.clone()
        self.m.mul_(b1).add_(self._local_grad(), alpha=1 - b1)
        scale = self.scaling[self.seg]
        self._onebit_mean(self.m.mul_(scale), "m").div_(scale)
        g_rec = (self.m - m_old * b1).div_(1 - b1)
        self.v_fresh.mul_(b2).addcmul_(g_rec, g_rec, value=1 - b2)
        bc1, bc2 = _corrections(self.bias_correction, self.betas, self.t, self.freeze_step)
        _, bc2_fresh = _corrections(self.bias_correction, self.betas, self.t, self.t)
        denom = (self.v / bc2).sqrt_().add_(self.eps)
        u_pre = self.m / bc1 / denom
        u = u_pre + self.wd * p if self.wd else u_pre
        ratio = denom.div_((self.v_fresh / bc2_fresh).sqrt_().add_(self.eps))
        factor = torch.zeros(len(self.flat.params), device=ratio.device).scatter_reduce_(
            0, self.seg, ratio, "amax", include_self=False)
        if self.wd:
            r = (self._per_tensor(u_pre * u_pre).sqrt() / self._per_tensor(u * u).sqrt()
                 .clamp_min(1e-30)).clamp_(max=1.0)
            factor = factor * r + (1 - r)
        factor = factor.clamp_(self.factor_min, self.factor_max)
        factor = torch.minimum(factor, self.last_factor * (1 + self.factor_threshold))
        factor = torch.maximum(factor, self.last_factor * (1 - self.factor_threshold))
        self.last_factor.copy_(factor)
        p.add_(u * (self.coeff_freeze * factor)[self.seg], alpha=-lr)

    def _direction(self, p: torch.Tensor, bc1: float, bc2: float) -> torch.Tensor:
        u = (self.m / bc1).div_((self.v / bc2).sqrt_().add_(self.eps))
        return u.add_(p, alpha=self.wd) if self.wd else u

    def _freeze(self) -> None:
        self.v_fresh.copy_(self.v)
        counts = self._per_tensor(torch.ones_like(self.m))
        scales = self._per_tensor(self.m * self.m).sqrt() / counts.sqrt()
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
                 lr: float, bc1: float = 1.0, bc2: float = 1.0) -> None:
    """p -= lr * ((m / bc1) / (sqrt(v / bc2) + eps) + wd * p); bc1 = bc2 = 1 is Adam without
    bias correction (DeepSpeed's 1-bit Adam)."""
    if wd:
        p.mul_(1 - lr * wd)
    p.addcdiv_(m, (v / bc2).sqrt_().add_(eps), value=-lr / bc1)
