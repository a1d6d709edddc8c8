"""Weight sync over a gloo group of a trainer and two replicas (troupe.parallel.weight_sync):
bucketed and bit-exact, a corrupted bucket caught by its checksum and never applied, a
replica that does not come named within the deadline, a model that differs named."""

import time

import pytest
import torch
from torch import nn

from troupe import collectives
from troupe.errors import WorkerCallError
from troupe.parallel import weight_sync
from troupe.parallel.weight_sync import WeightSyncError
from troupe.runtime import ActorGraph


def _model(seed: int, wider: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    d = 24 if wider else 16
    m = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, d), nn.LayerNorm(d),
                      nn.Linear(d, 16), nn.Linear(16, 50, bias=False))
    m[4].weight = m[0].weight  # tied: sent once
    return m


class _Corrupting:
    """The group, but the ``bucket``-th bucket to arrive has one bit flipped."""

    def __init__(self, comm, bucket: int):
        self.comm, self.bucket, self.seen = comm, bucket, -1

    def broadcast(self, x, src=0):
        self.comm.broadcast(x, src)
        if x.dtype == torch.uint8:
            self.seen += 1
            if self.seen == self.bucket:
                x[5] ^= 4
        return x

    def __getattr__(self, name):
        return getattr(self.comm, name)


class Member:
    """The trainer (seed 0) or a replica (seed 1 + rank) of the sync."""

    def __init__(self, wider: bool = False):
        from troupe.context import get_context
        ctx = get_context()
        self.model = _model(0 if ctx.role == "trainer" else 1 + ctx.rank,
                            wider and ctx.role == "replica" and ctx.rank == 1)

    def send(self, version: int, bucket_bytes: int, timeout_s: float,
             dtype: torch.dtype | None = None) -> dict:
        return vars(weight_sync.send(collectives.get_group("weights"),
                                     weight_sync.sync_tensors(self.model, dtype), version,
                                     bucket_bytes, timeout_s))

    def to(self, dtype: torch.dtype) -> None:
        self.model.to(dtype)

    def logprobs(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(self.model(ids).float(), -1)

    def send_in_background(self, version: int, bucket_bytes: int, timeout_s: float) -> dict:
        """Stage, start the send, change the weights while it runs, then its report."""
        staged = weight_sync.stage(weight_sync.sync_tensors(self.model), bucket_bytes)
        sending = weight_sync.BackgroundSend(collectives.get_group("weights"), staged,
                                             version, timeout_s)
        self.perturb()  # the trainer's next update, while the staged copy travels
        report = vars(sending.result())
        again = weight_sync.stage(weight_sync.sync_tensors(self.model), bucket_bytes,
                                  into=staged.buffer)
        report["reused"] = again.buffer.data_ptr() == staged.buffer.data_ptr()
        return report

    def receive(self, version: int, bucket_bytes: int, timeout_s: float,
                corrupt: int | None = None) -> dict:
        comm = collectives.get_group("weights")
        if corrupt is not None:
            comm = _Corrupting(comm, corrupt)
        return vars(weight_sync.receive(comm, weight_sync.sync_tensors(self.model), version,
                                        bucket_bytes, timeout_s))

    def state(self) -> dict:
        return {k: v.clone() for k, v in self.model.state_dict().items()}

    def perturb(self) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(0.01)

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


def _graph(name: str, wider: bool = False):
    return (ActorGraph(name)
            .role("trainer", Member, 1, num_cpus=0.5, config=wider)
            .role("replica", Member, 2, num_cpus=0.5, config=wider)
            .collective("weights", ["trainer", "replica"], backend="gloo")
            .build(timeout_s=120, call_timeout_s=120))


@pytest.fixture(scope="module")
def members(cluster):
    graph = _graph("weight-sync")
    yield graph["trainer"], graph["replica"]
    graph.shutdown()


def _sync(trainer, replicas, version, bucket_bytes=1024, timeout_s=30.0, **recv):
    r = replicas.call_async("receive", version, bucket_bytes, timeout_s, **recv)
    t = trainer.call_async("send", version, bucket_bytes, timeout_s)
    return t, r


def test_buckets_carry_every_weight_bit_for_bit(members):
    trainer, replicas = members
    t, r = _sync(trainer, replicas, 3)
    [sent], got = t.result(), r.result()
    want = trainer.call("state")[0]
    n = sum(p.numel() * 4 for p in _model(0).parameters())  # tied weight once
    assert sent["version"] == 3 and sent["buckets"] > 3
    assert n <= sent["bytes"] < n + sent["buckets"] * 4096  # whole checksum rows
    assert all(g["buckets"] == sent["buckets"] for g in got)
    for state in replicas.call("state"):
        assert state.keys() == want.keys()
        assert all(torch.equal(state[k], want[k]) for k in want)


def test_a_bf16_sync_is_an_fp32_sync_cast_on_arrival(cluster):
    """An fp32 sync, after which replica 1 casts its model to bf16; replica 0, its weights
    made to differ and cast to bf16, then gets a bf16 sync (half the bytes): the two
    replicas' log-probabilities are equal, bit for bit, and differ from the trainer's fp32
    ones by bf16's rounding."""
    graph = _graph("weight-sync-bf16")
    try:
        trainer, replicas = graph["trainer"], graph["replica"]
        t, r = _sync(trainer, replicas, 1, bucket_bytes=1 << 20)  # one bucket
        [fp32], _ = t.result(), r.result()
        replicas.call_rank(1, "to", torch.bfloat16)
        replicas.call_rank(0, "perturb")
        replicas.call_rank(0, "to", torch.bfloat16)
        ids = torch.arange(40).view(2, 20)
        cast = replicas.call_rank(1, "logprobs", ids)
        assert not torch.equal(replicas.call_rank(0, "logprobs", ids), cast)
        r = replicas.call_async("receive", 2, 1 << 20, 30.0)
        [bf16] = trainer.call("send", 2, 1 << 20, 30.0, torch.bfloat16)
        r.result()
        synced = replicas.call_rank(0, "logprobs", ids)
        [exact] = trainer.call("logprobs", ids)
    finally:
        graph.shutdown()
    assert torch.equal(synced, cast)
    assert 1e-4 < (synced - exact).abs().max() < 0.1
    assert bf16["bytes"] * 2 == fp32["bytes"]


def test_a_background_send_carries_the_weights_as_staged(members):
    """The staged copy is what arrives, bit for bit, though the trainer's weights changed
    while it travelled; a later stage reuses the buffer."""
    trainer, replicas = members
    before = trainer.call("state")[0]
    r = replicas.call_async("receive", 8, 1024, 30.0)
    [sent] = trainer.call("send_in_background", 8, 1024, 30.0)
    assert sent["version"] == 8 and sent["buckets"] > 3 and sent["seconds"] > 0
    assert sent["reused"]
    assert all(g["version"] == 8 for g in r.result())
    after = trainer.call("state")[0]
    assert not torch.equal(after["0.weight"], before["0.weight"])
    for state in replicas.call("state"):
        assert all(torch.equal(state[k], before[k]) for k in before)


def test_a_corrupted_bucket_is_caught_and_not_applied(members):
    trainer, replicas = members
    _sync(trainer, replicas, 4)[0].result()
    trainer.call("perturb")  # the trainer moves on: an applied bucket would show
    old = replicas.call("state")[1]
    calls = [replicas.invoke_on(0, Member.receive, 5, 1024, 30.0),
             replicas.invoke_on(1, Member.receive, 5, 1024, 30.0, 1)]  # bucket 1 flipped
    with pytest.raises(WorkerCallError) as sender:
        trainer.call("send", 5, 1024, 30.0)
    assert isinstance(sender.value.cause, WeightSyncError)
    assert "replica 1 (bucket 1)" in str(sender.value.cause)
    assert sender.value.cause.replicas == [1]
    calls[0].result()  # replica 0 is fine
    with pytest.raises(WorkerCallError) as replica:
        calls[1].result()
    assert isinstance(replica.value.cause, WeightSyncError)
    assert "bucket 1 of" in str(replica.value.cause) and "not applied" in str(replica.value.cause)
    new, (good, bad) = trainer.call("state")[0], replicas.call("state")
    assert all(torch.equal(good[k], new[k]) for k in new)
    tensors = weight_sync.sync_tensors(_model(0))
    layout = weight_sync.Layout.of(weight_sync.specs_of(tensors), 1024)
    in_bucket_1 = {name for (name, _), (b, _, _) in zip(tensors, layout.places) if b == 1}
    assert in_bucket_1
    for name in new:
        if name in in_bucket_1:
            assert torch.equal(bad[name], old[name]) and not torch.equal(bad[name], new[name])
        else:
            assert torch.equal(bad[name], new[name])


def test_a_replica_that_does_not_come_is_named_within_the_deadline(members):
    trainer, replicas = members
    sleeper = replicas.invoke_on(1, Member.sleep, 5.0)
    late = replicas.invoke_on(1, Member.receive, 6, 1024, 1.5)  # after its sleep
    on_time = replicas.invoke_on(0, Member.receive, 6, 1024, 1.5)
    t0 = time.monotonic()
    with pytest.raises(WorkerCallError) as e:
        trainer.call("send", 6, 1024, 1.5)
    assert time.monotonic() - t0 < 5
    err = e.value.cause
    assert isinstance(err, WeightSyncError) and err.replicas == [1]
    assert "replica 1 did not arrive within 1.5s" in str(err)
    sleeper.result()
    for call in (late, on_time):  # neither is left waiting
        with pytest.raises(WorkerCallError):
            call.result()


def test_a_replica_whose_model_differs_says_what_differs(cluster):
    graph = _graph("weight-sync-differs", wider=True)
    try:
        trainer, replicas = graph["trainer"], graph["replica"]
        r = [replicas.invoke_on(i, Member.receive, 1, 1 << 20, 30.0) for i in range(2)]
        with pytest.raises(WorkerCallError) as sender:
            trainer.call("send", 1, 1 << 20, 30.0)
        assert sender.value.cause.replicas == [1]
        r[0].result()
        with pytest.raises(WorkerCallError) as e:
            r[1].result()
        assert "replica 1's model differs from the trainer's" in str(e.value.cause)
        assert "tensor names/shapes/dtypes" in str(e.value.cause)
    finally:
        graph.shutdown()


def test_the_checksum_sees_a_flipped_bit_and_a_swap():
    x = torch.randint(0, 256, (4 * 4096,), dtype=torch.uint8)
    base = weight_sync.checksum(x)
    flipped = x.clone()
    flipped[100] ^= 1
    swapped = x.clone().view(torch.int64)
    swapped[[3, 7]] = swapped[[7, 3]]  # one row
    across = x.clone().view(torch.int64)
    across[[3, 515]] = across[[515, 3]]  # one column
    assert not torch.equal(weight_sync.checksum(flipped), base)
    assert not torch.equal(weight_sync.checksum(swapped.view(torch.uint8)), base)
    assert not torch.equal(weight_sync.checksum(across.view(torch.uint8)), base)
    assert torch.equal(weight_sync.checksum(x.clone()), base)
