"""Pretraining data larger than memory (troupe.data.stream), measured, one JSON line per figure:

    python benchmarks/data_stream.py [--sizes-gb 0.4 4] [--steps 40]

For each size, a corpus of parquet shards (64 MB each, documents of random words, made here
in a temporary directory; nothing downloaded), then:
- prepare: the shards tokenized (troupe's byte tokenizer) in Ray tasks, tokens/s;
- pass: a full pass over the corpus' windows as two data-parallel ranks read them (every
  window of the epoch, 512-token windows, batches of 64), tokens/s of the reading alone;
- train: ``--steps`` steps of a small GPT on 2 trainer ranks reading the corpus: each step's
  wait for data as a share of its time (goal under 5%), each trainer's peak resident memory
  (VmHWM) and its proportional set size at the end (PSS, /proc/PID/smaps_rollup), and the
  object store's use;
- memory-resident baseline (first size only, in a child process): today's TokenDataset
  reading the same shards whole, its peak resident memory and its bytes per token.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from machine import machine  # noqa: E402  benchmarks/machine.py, beside this script

SHARD_BYTES = 64 << 20
WORDS = np.array(("the of and to in is was for on that with as by at from his her it an "
                  "were are which this be or has had not but also first one their its new "
                  "after who they two have more other than all time into been year most "
                  "model token shard window rank epoch gradient layer expert batch").split())


def emit(line: dict) -> None:
    print(json.dumps({"bench": "data_stream", "machine": machine(), **line}), flush=True)


def make_corpus(root: Path, total_bytes: int, seed: int = 0) -> int:
    """Parquet shards of about SHARD_BYTES of text each, ``total_bytes`` in all; returns the
    bytes written."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    written, shard = 0, 0
    lengths = np.char.str_len(WORDS) + 1
    while written < total_bytes:
        docs, size = [], 0
        while size < min(SHARD_BYTES, total_bytes - written):
            ids = rng.integers(0, len(WORDS), size=(256, 400))  # 256 documents of 400 words
            docs += [" ".join(row) for row in WORDS[ids]]
            size += int(lengths[ids].sum())
        pq.write_table(pa.table({"text": docs}), root / f"part-{shard:05d}.parquet",
                       row_group_size=4096, compression="none")
        written, shard = written + size, shard + 1
    return written


def pss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def baseline(files: list[str]) -> dict:
    """Today's TokenDataset over the same shards, in a child process: its peak memory."""
    code = ("import resource, sys, json; from troupe.data import DataConfig, TokenDataset;"
            "d = TokenDataset(DataConfig(source=json.loads(sys.argv[1])));"
            "n = len(d.train) + len(d.val);"
            "print(json.dumps({'tokens': n, 'stream_bytes': d.train.nbytes + d.val.nbytes,"
            "'peak_rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(files)], capture_output=True,
                         text=True, cwd=str(Path(__file__).resolve().parent.parent))
    if out.returncode:
        return {"baseline_error": out.stderr.strip().splitlines()[-1]}
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return {**got, "peak_bytes_per_token": round(got["peak_rss_mb"] * 2**20 / got["tokens"], 2)}


def run(size_gb: float, a, tmp: Path) -> None:
    import ray
    from troupe.data import DataConfig
    from troupe.data.stream import StreamDataset, list_shards, prepare
    root = tmp / f"corpus-{size_gb:g}"
    t0 = time.perf_counter()
    written = make_corpus(root, int(size_gb * 1e9))
    emit({"size_gb": size_gb, "part": "corpus", "bytes": written,
          "shards": len(list_shards(str(root))), "made_s": round(time.perf_counter() - t0, 1)})
    cfg = DataConfig(source=str(root), val_fraction=0.001, cache_dir=str(tmp / "tokens"))
    prepared = prepare(cfg, None, cfg.cache_dir)
    tokens = prepared.train_tokens
    emit({"size_gb": size_gb, "part": "prepare", "train_tokens": tokens,
          "seconds": round(prepared.seconds, 1),
          "tokens_per_s": round(tokens / prepared.seconds),
          "token_bytes_on_disk": sum(f.stat().st_size for f in Path(prepared.directory).glob(
              "*.bin"))})
    data = StreamDataset(prepared, cfg.seed)
    L, B = 512, 64
    steps = data.windows(L) // B
    if a.pass_limit:
        steps = min(steps, a.pass_limit)
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        for rank in (0, 1):
            data.train_batch(step, B, L, rank, 2)
    seconds = time.perf_counter() - t0
    emit({"size_gb": size_gb, "part": "pass", "steps": steps, "windows": steps * B,
          "of_epoch": round(steps * B / data.windows(L), 3),
          "tokens_per_s": round(steps * B * L / seconds)})

    from troupe.pretrain import driver as pretrain
    from troupe.pretrain.config import PretrainConfig
    from troupe.pretrain.topology import TRAINER
    from troupe.pretrain.workers import TrainerActor
    run_cfg = PretrainConfig(
        model=dict(seq_len=256, n_layer=2, n_head=4, d_model=128),
        optimizer=dict(name="adamw", lr=1e-3, warmup_steps=2),
        data=cfg.model_dump(), workers=2, device="cpu",
        train=dict(steps=a.steps, batch_size=16, eval_every=0, checkpoint_every=0),
        out_dir=str(tmp / f"run-{size_gb:g}"))
    built = pretrain.build_graph(run_cfg, name=f"stream-{size_gb:g}")
    try:
        shares, peaks = [], [0.0, 0.0]
        for step in range(1, a.steps + 1):
            stats = built.graph[TRAINER].invoke(TrainerActor.train_step, step)
            if step > 1:
                shares.append(max(s.data_s / s.seconds for s in stats))
            peaks = [max(p, s.peak_memory_mb) for p, s in zip(peaks, stats)]
        pss = [pss_mb(info.pid) for info in built.trainers]
        store = ray.cluster_resources().get("object_store_memory", 0) - \
            ray.available_resources().get("object_store_memory", 0)
    finally:
        built.shutdown()
    emit({"size_gb": size_gb, "part": "train", "steps": a.steps, "ranks": 2,
          "data_wait_share_median": round(float(np.median(shares)), 4),
          "data_wait_share_max": round(max(shares), 4), "goal": 0.05,
          "peak_rss_mb_per_rank": [round(p) for p in peaks],
          "pss_mb_per_rank_at_end": [round(p) if p else None for p in pss],
          "object_store_used_mb": round(store / 2**20, 1)})
    if a.baseline and size_gb == a.sizes_gb[0]:
        emit({"size_gb": size_gb, "part": "in_memory_baseline",
              **baseline(list_shards(str(root)))})
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(prepared.directory, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes-gb", type=float, nargs="*", default=[0.4, 4.0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--pass-limit", type=int, default=0,
                   help="read at most this many steps in the pass (0: the whole epoch)")
    p.add_argument("--no-baseline", dest="baseline", action="store_false")
    p.add_argument("--dir", default=None, help="where the corpora are made (a temp dir)")
    a = p.parse_args()
    import troupe
    troupe.init(num_cpus=4)
    tmp = Path(a.dir or tempfile.mkdtemp(prefix="troupe-stream-"))
    try:
        for size in a.sizes_gb:
            run(size, a, tmp)
    finally:
        if a.dir is None:
            shutil.rmtree(tmp, ignore_errors=True)
    os._exit(0)


if __name__ == "__main__":
    main()
