"""ZeRO-3 (troupe.parallel.zero3) through the pretraining app: stage 3 gives stage 1's run
(dense and MoE, with an expert that gets no tokens on a rank), so does stage 2 with stage 1's
bytes, its checkpoints reshard from 2
to 4 to 1 ranks with exact values, export writes the model whole, and the memory budget
refuses a plan before anything is allocated."""

import pytest
import torch

from troupe import checkpoint as ckpt
from troupe.runtime import checkpoint
from tests.pretrain.test_driver import _cfg
from troupe.models import GPT, GPTConfig
from troupe.optim import OptimizerConfig
from troupe.parallel.reshard import assemble
from troupe.parallel.memory import GIB, MemoryBudgetError, check_budget, plan
from troupe.pretrain import driver as pretrain
from troupe.pretrain.export import load_full_model

DENSE = dict(model__moe=None)
# ep_size 1: the experts are partitioned over the whole data-parallel group
MOE1 = dict(model__moe=dict(num_experts=4, expert_interval=1, ep_size=1, capacity_factor=1.0,
                            min_capacity=2))


def _train(graphs, tmp_path, name, stage, **over):
    cfg = _cfg(tmp_path, name, zero_stage=stage, train__steps=6,
               train__checkpoint_every=0, **over)
    records = graphs.run(cfg, resume=None, progress=False)
    return cfg, [(r["kind"], r["step"], r.get("loss"), r.get("val_loss")) for r in records]


def _close(a, b, rel):
    assert [r[:2] for r in a] == [r[:2] for r in b]
    for x, y in zip(a, b):
        for u, v in zip(x[2:], y[2:]):
            assert (u is None) == (v is None)
            if u is not None:
                assert abs(u - v) <= rel * abs(v), (x, y)


# Qwen3's attention (q and k norms, heads of 32 over a width of 32 split in two) and a sliding
# window shorter than the sequences
QWEN3_WINDOW = dict(DENSE, model__positions="rope", model__norm="rmsnorm", model__mlp="swiglu",
                    model__n_kv_head=1, model__head_dim=32, model__qk_norm=True,
                    model__sliding_window=8, model__out_bias=False, model__mlp_bias=False)


@pytest.mark.parametrize("case,workers", [("dense", 2), ("moe-ep2", 2), ("moe-ep1", 4),
                                          ("dense-lamb-ckpt", 4), ("qwen3-window", 2)])
def test_stage3_gives_stage1s_run(pretrain_graphs, tmp_path, case, workers):
    """Same seed and data: the same losses. On 2 ranks bit for bit (two gradients sum alike
    in either order); on 4 within 1e-5 relative: the reduce-scatter is a ring, which sums
    each chunk from the rank after its owner, and the stages cut the buffer into other
    chunks (and LAMB's per-tensor norms are summed from other pieces on each rank)."""
    over = {"dense": DENSE, "moe-ep2": {}, "moe-ep1": MOE1,
            "dense-lamb-ckpt": dict(DENSE, optimizer__name="lamb",
                                    train__activation_checkpointing=True),
            "qwen3-window": QWEN3_WINDOW}[case]
    over = dict(over, workers=workers, train__batch_size=2 * workers)
    _, one = _train(pretrain_graphs, tmp_path, "one", 1, **over)
    cfg, three = _train(pretrain_graphs, tmp_path, "three", 3, **over)
    _close(three, one, 0.0 if workers == 2 else 1e-5)
    model = load_full_model(pretrain.checkpoint_root(cfg) / "step-00000006", cfg)
    assert sum(p.numel() for p in model.parameters()) == sum(
        p.numel() for p in GPT(cfg.model.architecture()).parameters())


def _per_step(records: list[dict], key: str) -> float:
    sent = [r[key] for r in records if r["kind"] == "train"]
    return (sent[-1] - sent[0]) / (len(sent) - 1)


def test_stage2_gives_stage1s_run_with_stage1s_bytes(pretrain_graphs, tmp_path):
    """Stage 2 keeps each block whole through a step: stage 1's losses bit for bit on 2
    ranks, and stage 1's bytes a step (one gather and one reduce-scatter of everything, each
    block's padding aside) where stage 3 gathers every block twice."""
    over = dict(DENSE, workers=2, train__batch_size=4, train__steps=6,
                train__checkpoint_every=0, train__eval_every=0)  # an evaluation gathers
    runs = {stage: pretrain_graphs.run(_cfg(tmp_path, f"s{stage}", zero_stage=stage, **over),
                                       resume=None, progress=False) for stage in (1, 2, 3)}
    key = lambda r: (r["kind"], r["step"], r.get("loss"), r.get("val_loss"))  # noqa: E731
    assert [key(r) for r in runs[2]] == [key(r) for r in runs[1]]
    one, two, three = (_per_step(runs[s], "bytes_sent") for s in (1, 2, 3))
    assert abs(two - one) <= 0.01 * one, (one, two)
    assert three > 1.25 * one, (one, three)  # the root (a third of this model) once


def test_stage2_with_micro_batches_and_experts_resumes_on_another_world(pretrain_graphs,
                                                                       tmp_path):
    """MoE over 4 ranks, two micro-batches a step (the second gathers nothing): stage 1's run
    within 1e-5; its checkpoint, stage 3's layout, resumed by 2 ranks."""
    over = dict(MOE1, workers=4, train__batch_size=8, train__micro_batch_size=1)
    _, one = _train(pretrain_graphs, tmp_path, "one", 1, **over)
    cfg, two = _train(pretrain_graphs, tmp_path, "two", 2, **over)
    _close(two, one, 1e-5)
    half = _cfg(tmp_path, "half", zero_stage=2, **dict(over, workers=2, train__steps=8))
    records = pretrain_graphs.run(half, resume=str(pretrain.checkpoint_root(cfg) /
                                                   "step-00000006"), progress=False)
    assert [r["step"] for r in records if r["kind"] == "train"] == [7, 8]


def test_an_expert_without_tokens_still_joins_every_collective(pretrain_graphs, tmp_path):
    """Top-1 routing over 8 experts with 2 of 16 tokens per rank: most experts get nothing on
    a rank at every step (the stage that hangs when a rank skips an idle expert's
    reduce-scatter); the run completes and equals stage 1's."""
    over = dict(model__moe=dict(num_experts=8, expert_interval=1, ep_size=1, top_k=1,
                                capacity_factor=1.0, min_capacity=1),
                model__seq_len=2, train__batch_size=2, workers=2)
    _, one = _train(pretrain_graphs, tmp_path, "one", 1, **over)
    _, three = _train(pretrain_graphs, tmp_path, "three", 3, **over)
    _close(three, one, 0.0)


def _dense_state(directory) -> dict[str, torch.Tensor]:
    """The dense bucket of a stage-3 checkpoint whole: weights and Adam's moments."""
    manifest = ckpt.read_manifest(directory)
    W = manifest["roles"]["trainer"]
    states = [ckpt.read_rank(directory, r, manifest)["buckets"]["dense"] for r in range(W)]
    whole = {"params": [s["params"] for s in states]}
    for k in states[0]["optimizer"]["tensors"]:
        whole[k] = [s["optimizer"]["tensors"][k] for s in states]
    numels = [[n] for n, _ in states[0]["layout"]]  # each partition as one run of values
    return {k: torch.cat(assemble(shards, numels)) for k, shards in whole.items()}


def _resave(graphs, cfg, source, target) -> None:
    """Load ``source`` into a graph of cfg.workers ranks set up afresh and save it as
    ``target``."""
    with graphs.use(cfg) as built:
        step = pretrain._resume(built.graph, cfg, str(source))
        checkpoint.save(pretrain._checkpointed(built.graph), target, step,
                        optimizer=cfg.optimizer.name, zero_stage=3,
                        config=cfg.model_dump(mode="json"))


def test_checkpoints_reshard_2_to_4_to_1_exactly(pretrain_graphs, tmp_path):
    """A stage-3 checkpoint of 2 ranks loaded by 4 and saved again holds exactly the same
    weights and optimizer moments; so does that one loaded by 1. A run resumed across world
    sizes goes on as the uninterrupted one does (within the rounding of the reduction)."""
    base = dict(DENSE, zero_stage=3, train__steps=6, train__checkpoint_every=2,
                train__batch_size=4)
    two = _cfg(tmp_path, "two", workers=2, **base)
    pretrain_graphs.run(two, resume=None, stop_after=4, progress=False)
    step2 = pretrain.checkpoint_root(two) / "step-00000002"
    four = _cfg(tmp_path, "four", workers=4, **base)
    _resave(pretrain_graphs, four, step2, tmp_path / "as4")
    as4 = ckpt.latest(tmp_path / "as4")
    assert ckpt.read_manifest(as4)["roles"] == {"trainer": 4}
    one = _cfg(tmp_path, "one", workers=1, **base)
    _resave(pretrain_graphs, one, as4, tmp_path / "as1")
    as1 = ckpt.latest(tmp_path / "as1")
    want = _dense_state(step2)
    for got in (_dense_state(as4), _dense_state(as1)):
        assert set(got) == set(want) == {"params", "m", "v"}
        assert all(torch.equal(got[k], want[k]) for k in want)
    # resumed on 4 from step 2 and on 1 from there: the run of 2 ranks, within rounding
    records = pretrain_graphs.run(four, resume=str(step2), progress=False)
    assert [r["step"] for r in records if r["kind"] == "train"] == [3, 4, 5, 6]
    straight = load_full_model(pretrain.checkpoint_root(two) / "step-00000004", two)
    resumed = load_full_model(pretrain.checkpoint_root(four) / "step-00000004", four)
    for k, v in straight.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[k], v, rtol=1e-5, atol=1e-6)
    last = pretrain_graphs.run(one, resume=str(pretrain.checkpoint_root(four) / "step-00000004"),
                               progress=False)
    assert [r["step"] for r in last if r["kind"] == "train"] == [5, 6]


def test_a_stage1_checkpoint_is_not_resumed_by_stage3(pretrain_graphs, tmp_path):
    one = _cfg(tmp_path, "run", workers=2, train__steps=2, train__checkpoint_every=2, **DENSE)
    pretrain_graphs.run(one, resume=None, progress=False)
    three = _cfg(tmp_path, "run", workers=2, train__steps=4, zero_stage=3, **DENSE)
    with pytest.raises(Exception, match="zero_stage"):
        pretrain_graphs.run(three, resume="auto", progress=False)


def _billion() -> GPT:
    """A Llama-architecture model of about 1.1B parameters, shapes only."""
    cfg = GPTConfig(vocab_size=32000, seq_len=2048, n_layer=22, n_head=32, n_kv_head=4,
                    d_model=2048, d_ff=5632, norm="rmsnorm", positions="rope", mlp="swiglu",
                    out_bias=False, mlp_bias=False, tie_embeddings=False)
    with torch.device("meta"):
        return GPT(cfg)


def test_the_memory_plan_refuses_stage1_and_admits_stage3():
    model = _billion()
    P = sum(p.numel() for p in model.parameters())
    assert 1.0e9 < P < 1.2e9
    adamw = OptimizerConfig()
    for W in (1, 2, 4):
        one = plan(model, adamw, W)
        assert one.params == one.grads == 4 * P and one.optimizer >= 8 * P // W
        with pytest.raises(MemoryBudgetError, match=r"rank 0: zero_stage 1 plans .* over "
                                                    r"memory_per_worker=10 GiB; zero_stage 3 "):
            check_budget(one, 10, "rank 0", plan(model, adamw, W, zero_stage=3))
    three = plan(model, adamw, 2, zero_stage=3)
    assert three.params + three.grads + three.optimizer <= 1.02 * 16 * P / 2
    check_budget(three, 10, "rank 0")  # admitted
    assert three.total < 10 * GIB
    two = plan(model, adamw, 2, zero_stage=2)  # stage 3's shards, every block kept whole
    assert (two.params, two.grads, two.optimizer) == (three.params, three.grads,
                                                      three.optimizer)
    assert 4 * P < two.gathered < 1.3 * 4 * P and two.zero_stage == 2


def _losses_on(device: str, stage: int, workers: int = 1) -> list[float]:
    from troupe.pretrain.config import PretrainConfig
    from troupe.pretrain.rank import Trainer
    cfg = PretrainConfig(model={"d_model": 64, "n_layer": 3, "n_head": 2, "seq_len": 32},
                         workers=workers, device=device, zero_stage=stage,
                         train={"batch_size": 8, "steps": 4, "micro_batch_size": 4})
    worker = Trainer(cfg, 0, 1, None)
    return [worker.train_step(step).loss for step in range(1, 5)]


@pytest.mark.gpu
def test_stage3_on_cuda_gives_stage1s_losses():
    """The one code path on a GPU: the partitions, the gathers (the communication thread's
    stream synchronised) and the gradient shards live on cuda; four steps of two
    micro-batches give stage 1's losses (stage 2's too), and the CPU's within 1e-4."""
    cuda3, cuda1, cpu3 = _losses_on("cuda", 3), _losses_on("cuda", 1), _losses_on("cpu", 3)
    assert cuda3 == pytest.approx(cuda1, rel=1e-6)
    assert _losses_on("cuda", 2) == pytest.approx(cuda1, rel=1e-6)
    assert cuda3 == pytest.approx(cpu3, rel=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_stage3_over_nccl_gives_stage1s_run(pretrain_graphs, tmp_path):
    over = dict(DENSE, workers=2, train__batch_size=4, device="cuda")
    _, one = _train(pretrain_graphs, tmp_path, "one", 1, **over)
    _, three = _train(pretrain_graphs, tmp_path, "three", 3, **over)
    _close(three, one, 1e-5)
