"""Optimizers on 2 and 4 gloo ranks against single-process references, and their invariants."""

import pytest
import torch

from troupe import collectives
from troupe.actors import PerRank
from troupe.optim import Adam, CommCounter, FlatParams, Lamb, OptimizerConfig, build_optimizer
from troupe.optim.chunks import ChunkLayout
from troupe.runtime import ActorGraph, get_context


def _model(width: int = 16) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, width), torch.nn.Tanh(),
                               torch.nn.Linear(width, 3))


def _grads_step(model, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    torch.nn.functional.mse_loss(model(x), y).backward()


class OptRank:
    """Trains the shared toy model on this rank's data with a given optimizer."""

    def train(self, cfg: dict, steps: int, lr: float = 1e-2, save_at: int | None = None,
              width: int = 16):
        group = collectives.get_group("dp")
        model = _model(width)
        flat = FlatParams(model.parameters(), align=group.world_size)
        opt = build_optimizer(OptimizerConfig(**cfg), flat, group)
        history, saved = [], None
        for t in range(1, steps + 1):
            _grads_step(model, get_context().rank, t)
            opt.step(lr)
            flat.zero_grad()
            history.append(dict(p=flat.data.clone(), v=opt.state_tensors()["v"].clone()))
            if t == save_at:
                saved = (flat.data.clone(), opt.state_dict())
        return history, opt.state_bytes(), opt.comm.bytes_sent, saved

    def state_sizes(self, cfg: dict, steps: int, width: int = 16) -> dict[str, int]:
        """Bytes of each optimizer tensor after ``steps`` (error feedback summed by kind)."""
        group = collectives.get_group("dp")
        model = _model(width)
        flat = FlatParams(model.parameters(), align=group.world_size)
        opt = build_optimizer(OptimizerConfig(**cfg), flat, group)
        for t in range(1, steps + 1):
            _grads_step(model, get_context().rank, t)
            opt.step(1e-2)
            flat.zero_grad()
        sizes = {k: v.numel() * v.element_size() for k, v in opt.state_tensors().items()}
        for states in opt.onebit.values():
            for st in states:
                for kind, t in st.state_dict().items():
                    sizes[kind] = sizes.get(kind, 0) + (t.numel() * 4 if t is not None else 0)
        return {"flat_numel": flat.numel, **sizes}

    def resume(self, saved, cfg: dict, start: int, steps: int, lr: float = 1e-2):
        group = collectives.get_group("dp")
        model = _model()
        flat = FlatParams(model.parameters(), align=group.world_size)
        flat.data.copy_(saved[0])
        opt = build_optimizer(OptimizerConfig(**cfg), flat, group)
        opt.load_state_dict(saved[1])
        for t in range(start + 1, steps + 1):
            _grads_step(model, get_context().rank, t)
            opt.step(lr)
            flat.zero_grad()
        return flat.data.clone()


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request, cluster):
    graph = (ActorGraph(f"opt{request.param}").role("w", OptRank, request.param, num_cpus=1)
             .collective("dp", ["w"], "gloo").build(timeout_s=120, call_timeout_s=300))
    yield graph["w"]
    graph.shutdown()


def _mean_grad_reference(opt_factory, world: int, steps: int, lr: float = 1e-2):
    """One process: the mean of the ranks' gradients, fed to a single-rank optimizer."""
    model = _model()
    flat = FlatParams(model.parameters(), align=world)
    opt = opt_factory(flat)
    out = []
    for t in range(1, steps + 1):
        grads = []
        for r in range(world):
            flat.zero_grad()
            _grads_step(model, r, t)
            grads.append(flat.grad.clone())
        flat.grad.copy_(torch.stack(grads).sum(0) / world)
        opt.step(lr)
        out.append(flat.data.clone())
    return out


def test_onebit_adam_before_freeze_is_adam_without_bias_correction(ranks):
    steps = 6
    for bc in (False, True):
        results = ranks.invoke(OptRank.train, dict(name="onebit_adam", freeze_step=10 ** 6,
                                           bias_correction=bc), steps)
        want = _mean_grad_reference(
            lambda f: Adam(f, betas=(0.9, 0.999), eps=1e-8, bias_correction=bc),  # noqa: B023
            ranks.world_size, steps)
        for history, *_ in results:
            for t in range(steps):
                torch.testing.assert_close(history[t]["p"], want[t], atol=2e-7, rtol=0)


def test_onebit_adam_freezes_variance_and_ranks_agree(ranks):
    freeze, steps = 3, 8
    results = ranks.invoke(OptRank.train, dict(name="onebit_adam", freeze_step=freeze), steps)
    for history, *_ in results:
        assert not torch.equal(history[freeze - 2]["v"], history[freeze - 1]["v"])
        for t in range(freeze, steps):
            assert torch.equal(history[t]["v"], history[freeze - 1]["v"])
    for t in range(steps):  # compressed momentum is identical on every rank, so are parameters
        for history, *_ in results[1:]:
            assert torch.equal(history[t]["p"], results[0][0][t]["p"])


@pytest.mark.parametrize("name", ["adam", "adamw", "lamb"])
def test_sharded_matches_single_process(ranks, name):
    W, steps = ranks.world_size, 5
    cfg = dict(name=name, weight_decay=0.01)
    results = ranks.invoke(OptRank.train, cfg, steps)
    if name == "lamb":
        factory = lambda f: Lamb(f, weight_decay=0.01, eps=1e-8)  # noqa: E731
    else:
        factory = lambda f: Adam(f, weight_decay=0.01, decoupled=name == "adamw")  # noqa: E731
    want = _mean_grad_reference(factory, W, steps)
    for history, state_bytes, _, _ in results:
        torch.testing.assert_close(history[-1]["p"], want[-1], atol=1e-6, rtol=1e-5)
        n = history[-1]["p"].numel()
        assert state_bytes == 2 * 4 * n // W  # m and v of this rank's 1/W only


def test_zero_one_adam_syncs_ranks_and_updates_variance_on_schedule(ranks):
    cfg = dict(name="zero_one_adam", var_freeze_step=6, var_update_scaler=2,
               local_step_scaler=4, local_step_clipper=4)
    history = [h for h, *_ in ranks.invoke(OptRank.train, cfg, 16)]
    # variance updates at t % interval == 0, interval 1,1,2,2,4...: steps 1, 2, 4, 6
    changed = [t + 1 for t in range(1, 16) if not torch.equal(history[0][t]["v"],
                                                                history[0][t - 1]["v"])]
    assert changed == [2, 4, 6]
    # local steps after 6: the interval is 1, doubles at steps 10 and 14 (every 4 steps), up to
    # 4: syncs at 7, 8, 9, 10, 12, 14, then 18
    for t in (7, 8, 9, 10, 12, 14):
        for h in history[1:]:
            assert torch.equal(h[t - 1]["p"], history[0][t - 1]["p"]), f"step {t}"
    for t in (11, 13, 15, 16):  # local steps
        assert not torch.equal(history[1][t - 1]["p"], history[0][t - 1]["p"]), f"step {t}"


def test_zero_one_adam_clips_each_tensors_update(ranks):
    """update_clip caps the RMS of each tensor's step at update_clip * lr, in the variance
    phase and on the local steps after it (the schedule of the test above: 11, 13, 15, 16 are
    local); without it, the same run takes larger steps."""
    cfg = dict(name="zero_one_adam", var_freeze_step=6, var_update_scaler=2,
               local_step_scaler=4, local_step_clipper=4)
    lr, clip, steps = 1e-2, 0.5, 16
    initial = FlatParams(_model().parameters(), align=ranks.world_size)
    segments, start = initial.segments, initial.data

    def step_rms(update_clip: float) -> list[list[float]]:
        """Per checked step, each tensor's RMS step / lr (on rank 0)."""
        history = ranks.invoke(OptRank.train, dict(cfg, update_clip=update_clip), steps, lr)[0][0]
        p = [start] + [h["p"] for h in history]
        return [[float((p[t][o:o + n] - p[t - 1][o:o + n]).square().mean().sqrt()) / lr
                 for o, n in segments] for t in (1, 2, 3, 4, 5, 6, 11, 13, 15, 16)]

    clipped, free = step_rms(clip), step_rms(0.0)
    assert max(max(r) for r in clipped) <= clip * (1 + 1e-5)
    for phase in (clipped[:6], clipped[6:]):  # the cap is reached in both phases
        assert max(max(r) for r in phase) >= clip * (1 - 1e-5)
    assert max(max(r) for r in free) > 1.5 * clip


def test_onebit_lamb_ranks_agree_and_train(ranks):
    cfg = dict(name="onebit_lamb", freeze_step=4, weight_decay=0.01)
    results = ranks.invoke(OptRank.train, cfg, 10)
    for history, *_ in results[1:]:
        assert torch.equal(history[-1]["p"], results[0][0][-1]["p"])
        assert torch.equal(history[-1]["v"], history[3]["v"])  # frozen after step 4


@pytest.mark.parametrize("name,shard_state,save_at", [
    ("adamw", False, 5), ("lamb", False, 5), ("onebit_adam", False, 5),
    ("zero_one_adam", False, 5), ("onebit_lamb", False, 5),
    # sharded, saved before and after the phase change (its state changes shape there)
    ("onebit_adam", True, 2), ("onebit_adam", True, 5), ("zero_one_adam", True, 2),
    ("zero_one_adam", True, 5), ("onebit_lamb", True, 2), ("onebit_lamb", True, 5)])
def test_state_dict_resume_is_exact(ranks, name, shard_state, save_at):
    cfg = dict(name=name, freeze_step=3, var_freeze_step=3, var_update_scaler=1,
               local_step_scaler=2, local_step_clipper=4, shard_state=shard_state)
    results = ranks.invoke(OptRank.train, cfg, 9, 1e-2, save_at)
    resumed = ranks.invoke(OptRank.resume, PerRank([r[3] for r in results]), cfg, save_at, 9)
    for (history, *_), p in zip(results, resumed):
        assert torch.equal(p, history[-1]["p"])


ONEBIT = {  # each through its phase changes within 50 steps, with weight decay
    "onebit_adam": dict(name="onebit_adam", freeze_step=10, weight_decay=0.01),
    "zero_one_adam": dict(name="zero_one_adam", var_freeze_step=20, var_update_scaler=2,
                          local_step_scaler=8, local_step_clipper=4, weight_decay=0.01),
    "onebit_lamb": dict(name="onebit_lamb", freeze_step=10, weight_decay=0.01),
}


@pytest.mark.parametrize("name", list(ONEBIT))
def test_sharded_state_trains_exactly_as_whole_state(ranks, name):
    """shard_state=True: every rank's parameters after each of 50 steps equal, bit for bit,
    those of the run with the whole state (warm-up, freeze, compressed steps; 0/1 Adam's
    variance steps, local steps and syncs)."""
    steps = 50
    whole = ranks.invoke(OptRank.train, ONEBIT[name], steps, 1e-2, None, 24)
    sharded = ranks.invoke(OptRank.train, dict(ONEBIT[name], shard_state=True), steps, 1e-2, None, 24)
    start = FlatParams(_model(24).parameters(), align=ranks.world_size).data
    for (h_whole, *_), (h_sharded, *_) in zip(whole, sharded):
        for t in range(steps):
            assert torch.equal(h_sharded[t]["p"], h_whole[t]["p"]), f"step {t + 1}"
        assert (h_whole[-1]["p"] - start).norm() > 0.1  # it trained


def test_sharded_state_keeps_a_wth_of_the_variance(ranks):
    """Per rank after the freeze: 1-bit Adam's and 1-bit LAMB's variances (and LAMB's fresh
    variance) are 1/W of the whole state's; the momentum is packed (1 bit an element) either
    way; the worker error feedback stays whole and the server's is 1/W already."""
    W, width = ranks.world_size, 64
    for name in ("onebit_adam", "onebit_lamb"):
        cfg = dict(ONEBIT[name], freeze_step=2)
        whole = ranks.invoke(OptRank.state_sizes, cfg, 4, width)
        sharded = ranks.invoke(OptRank.state_sizes, dict(cfg, shard_state=True), 4, width)
        for w, s in zip(whole, sharded):
            n = w["flat_numel"]
            for key in ("v", "v_fresh") if name == "onebit_lamb" else ("v",):
                assert s[key] * W == w[key]
                assert w[key] < 4 * n * 1.05  # the layout pads each tensor a little
            assert s["m_signs"] == w["m_signs"] and n / 8 <= s["m_signs"] < n / 8 * 1.05
            assert "m" not in s and "m" not in w
            assert s["worker_error"] == w["worker_error"] >= 4 * n
            assert s["server_error"] == w["server_error"] == w["worker_error"] // W


def test_1bit_sends_fewer_bytes(ranks):
    steps = 12
    adam = ranks.invoke(OptRank.train, dict(name="adam"), steps, 1e-2, None, 512)[0][2]
    onebit = ranks.invoke(OptRank.train, dict(name="onebit_adam", freeze_step=2), steps, 1e-2, None,
                        512)[0][2]
    assert onebit < adam / 4


def test_onebit_lamb_before_freeze_is_lamb(ranks):
    steps = 5
    results = ranks.invoke(OptRank.train, dict(name="onebit_lamb", freeze_step=10 ** 6, eps=1e-6,
                                       weight_decay=0.01), steps)
    want = _mean_grad_reference(lambda f: Lamb(f, eps=1e-6, weight_decay=0.01),
                                ranks.world_size, steps)
    for history, *_ in results:
        torch.testing.assert_close(history[-1]["p"], want[-1], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["adamw", "onebit_adam"])
def test_bf16_gradient_reduction_halves_the_bytes_and_stays_close(ranks, name):
    """reduce_dtype=bf16: the ZeRO reduce-scatter (adamw; its fp32 all-gather of parameters
    stays) or the 1-bit warm-up allreduce (onebit_adam, before its freeze) carries bf16: half
    those bytes, every rank the same weights, and after 5 steps within a few percent of the
    fp32 run's movement (bf16's 8-bit mantissa; where ranks' gradients nearly cancel, the
    rounded mean can point the other way, and Adam moves such a weight by lr regardless)."""
    W, steps = ranks.world_size, 5
    base = dict(name=name, freeze_step=10 ** 6)
    fp32 = ranks.invoke(OptRank.train, base, steps)
    bf16 = ranks.invoke(OptRank.train, dict(base, reduce_dtype="bf16"), steps)
    flat = FlatParams(_model().parameters(), align=W)
    start, reduced = flat.data, CommCounter()
    if name == "adamw":  # the padded buffer, scattered
        reduced.reduce_scatter(flat.padded * 4, W)
    else:  # the gradients in the chunk layout, scattered, and the mean gathered
        layout = ChunkLayout(flat.segments, W)
        reduced.reduce_scatter(W * layout.S * 4, W)
        reduced.all_gather(layout.S * 4, W)
    assert fp32[0][2] - bf16[0][2] == steps * reduced.bytes_sent // 2
    for history, *_ in bf16[1:]:
        assert torch.equal(history[-1]["p"], bf16[0][0][-1]["p"])
    p32, p16 = fp32[0][0][-1]["p"], bf16[0][0][-1]["p"]
    assert 0 < (p16 - p32).norm() < 0.05 * (p32 - start).norm()


@pytest.mark.parametrize("decoupled", [True, False])
def test_fused_adam_step_is_the_textbook_update(decoupled):
    """AdamRule's fused kernel (fp32 with bias correction) against Adam written out op by op
    (the chunked path's formula): within a few ulp after five steps, and the gradient left as
    it was."""
    from troupe.optim import AdamRule

    g = torch.Generator().manual_seed(1)
    n, lr, wd, (b1, b2), eps = 100_003, 1e-3, 0.1, (0.9, 0.999), 1e-8
    p = torch.randn(n, generator=g)
    want, m, v = p.clone(), torch.zeros(n), torch.zeros(n)
    rule = AdamRule(n, (b1, b2), eps, wd, decoupled=decoupled)
    for t in range(1, 6):
        grad = torch.randn(n, generator=g) * 1e-2
        kept = grad.clone()
        rule.update(p, grad, lr, t)
        assert torch.equal(grad, kept)
        gc = grad if decoupled else grad + wd * want
        m.mul_(b1).add_(gc, alpha=1 - b1)
        v.mul_(b2).addcmul_(gc, gc, value=1 - b2)
        if decoupled:
            want.mul_(1 - lr * wd)
        want.addcdiv_(m, (v / (1 - b2 ** t)).sqrt_().add_(eps), value=-lr / (1 - b1 ** t))
    torch.testing.assert_close(p, want, rtol=0, atol=1e-6)
    # (the kernel's m is a lerp: other roundings, ~1e-9 on moments of ~1e-3)
    torch.testing.assert_close(rule.m, m, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(rule.v, v, rtol=1e-5, atol=1e-12)
