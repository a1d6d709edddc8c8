"""A corpus streamed from shards (troupe.data.stream): tokenized once in Ray tasks, read
window by window in a global order that is a function of (seed, step) alone, each rank its
slice; held out by each document's hash; bad rows named, or skipped and counted."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from troupe.data import DataConfig, open_dataset
from troupe.data.stream import StreamDataset, is_stream, list_shards, prepare
from troupe.errors import DataError

from tests.data.corpus import make_corpus


def _cfg(root, **over) -> DataConfig:
    return DataConfig(source=str(root), val_fraction=0.1, **over)


def test_a_directory_streams_and_a_list_of_files_does_not(tmp_path):
    root = make_corpus(tmp_path / "c")
    assert is_stream(str(root)) and is_stream(f"{root}/*.parquet") and is_stream(f"file://{root}")
    assert not is_stream(str(root / "part-000.parquet")) and not is_stream("stdlib")
    assert [p.rsplit("/", 1)[1] for p in list_shards(f"file://{root}")] == [
        "more.jsonl", "notes.txt", "part-000.parquet", "part-001.parquet", "part-002.parquet"]


def test_global_batches_are_the_seeds_and_ranks_read_their_slices(cluster, tmp_path):
    root = make_corpus(tmp_path / "c")
    cfg = _cfg(root, cache_dir=str(tmp_path / "tokens"))
    data = open_dataset(cfg)
    assert isinstance(data, StreamDataset)
    prepared = data.prepared
    assert prepared.report()["documents"] == 3 * 40 + 40 + 1
    again = StreamDataset(prepare(cfg, None, cfg.cache_dir), cfg.seed)  # from the cache
    assert again.prepared.directory == prepared.directory and again.prepared.seconds == 0.0
    whole = data.train_batch(3, 8, 32)
    halves = [again.train_batch(3, 8, 32, rank, 2) for rank in (0, 1)]
    assert all(np.array_equal(np.concatenate([h[k] for h in halves]), whole[k])
               for k in (0, 1))
    assert not np.array_equal(data.train_batch(4, 8, 32)[0], whole[0])
    # an epoch is every window once, in an order of its own
    N = data.windows(32)
    seen = np.concatenate([data.train_batch(s, 4, 32)[0][:, 0] for s in range(1, N // 4 + 1)])
    x, _ = data.train_batch(1, N, 32)
    assert sorted(x[:, :4].tolist()) == sorted(
        np.concatenate([data.train_batch(s, 1, 32)[0][:, :4] for s in range(1, N + 1)]).tolist())
    assert len(seen) == N // 4 * 4
    second = data.train_batch(N + 1, N, 32)[0]  # epoch 1: the same windows, reordered
    assert sorted(second[:, :4].tolist()) == sorted(x[:, :4].tolist())
    assert data.position(N + 1, 1, 32)["epoch"] == 1


def test_the_held_out_documents_stay_as_shards_are_added(cluster, tmp_path):
    root = make_corpus(tmp_path / "c")
    first = prepare(_cfg(root), None, tmp_path / "t")
    pq.write_table(pa.table({"text": [f"new {i}" + "x" * 50 for i in range(30)]}),
                   root / "part-009.parquet")
    second = prepare(_cfg(root), None, tmp_path / "t")
    assert second.key != first.key
    old = {s.source: s for s in first.shards}
    for s in second.shards:
        if s.source in old:  # a shard's split does not depend on the others
            assert (s.train_docs, s.val_docs) == (old[s.source].train_docs,
                                                  old[s.source].val_docs)


def test_bad_rows_are_named_or_skipped_and_counted(cluster, tmp_path):
    root = make_corpus(tmp_path / "c", shards=1)
    pq.write_table(pa.table({"text": ["fine " * 20, None, "also fine " * 10]}),
                   root / "part-005.parquet")
    (root / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match=r"empty.jsonl: an empty file"):
        prepare(_cfg(root), None, tmp_path / "t")
    (root / "empty.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(DataError, match=r"empty.jsonl: line 2: no string 'text' field"):
        prepare(_cfg(root), None, tmp_path / "t")
    skipped = prepare(_cfg(root, skip_bad=True), None, tmp_path / "t").report()
    assert skipped["skipped_rows"] == 2 and "empty.jsonl: line 2" in skipped["first_skipped"]
    (root / "broken.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DataError, match=r"broken.parquet: not a readable parquet file"):
        prepare(_cfg(root, skip_bad=False), None, tmp_path / "t")


def test_pretraining_from_shards_resumes_exactly_also_on_fewer_ranks(pretrain_graphs,
                                                                       tmp_path):
    """Stopped at step 4 and resumed: the losses of the uninterrupted run (the same batches),
    on the same 2 ranks and on 1; each record says where the run is in the corpus."""
    from troupe.pretrain.config import PretrainConfig
    root = make_corpus(tmp_path / "c", shards=4, docs=60)

    def cfg(name, workers=2):
        return PretrainConfig(
            model=dict(seq_len=32, n_layer=2, n_head=2, d_model=32),
            optimizer=dict(name="adamw", lr=3e-3, warmup_steps=2),
            data=dict(source=str(root), cache_dir=str(tmp_path / "tokens")),
            train=dict(steps=8, batch_size=4, eval_every=4, eval_batches=2,
                       checkpoint_every=4), workers=workers, out_dir=str(tmp_path / name))

    full = pretrain_graphs.run(cfg("full"), resume=None, progress=False)
    train = [r for r in full if r["kind"] == "train"]
    assert [r["tokens_consumed"] for r in train] == [s * 4 * 32 for s in range(1, 9)]
    assert all(r["epoch"] == 0 and r["shard"].startswith("train-") for r in train)
    assert all(0 <= r["data_s"] < r["seconds"] for r in train)
    losses = {r["step"]: r["loss"] for r in train}
    pretrain_graphs.run(cfg("split"), resume=None, stop_after=4, progress=False)
    again = pretrain_graphs.run(cfg("split"), resume="auto", progress=False)
    assert {r["step"]: r["loss"] for r in again if r["kind"] == "train"} == \
        {s: losses[s] for s in (5, 6, 7, 8)}
    one = pretrain_graphs.run(cfg("one", workers=1),
                              resume=str(tmp_path / "split" / "checkpoints" / "step-00000004"),
                              progress=False)
    got = {r["step"]: r["loss"] for r in one if r["kind"] == "train"}
    assert all(abs(got[s] - losses[s]) <= 1e-5 * losses[s] for s in (5, 6, 7, 8))
    data = json.loads((tmp_path / "full" / "metrics.jsonl").read_text().splitlines()[0])
    assert data["kind"] == "data" and data["shards"] == 6


def test_an_epoch_is_every_window_once_with_a_short_last_chunk(tmp_path, monkeypatch):
    """The order of N windows (N not a multiple of the chunk): a permutation of 0..N-1,
    another one the next epoch."""
    from troupe.data import stream
    monkeypatch.setattr(stream, "CHUNK", 8)
    data = StreamDataset.__new__(StreamDataset)
    data.seed, data._perm = 7, {}
    N = 8 * 5 + 3
    first = [data._order(0, N, i) for i in range(N)]
    second = [data._order(1, N, i) for i in range(N)]
    assert sorted(first) == sorted(second) == list(range(N)) and first != second
