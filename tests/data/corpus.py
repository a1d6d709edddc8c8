"""A small corpus of shards for the streaming tests (troupe.data.stream): parquet, jsonl and
.txt files of random words."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def _words(rng, n):
    vocab = ["alpha", "beta", "gamma", "delta", "shard", "window", "token", "epoch", "rank"]
    return " ".join(rng.choice(vocab, n))


def make_corpus(root, shards=3, docs=40, seed=0):
    """``shards`` parquet files of ``docs`` documents, a jsonl and a .txt one beside them."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        texts = [f"doc {s}.{i}: " + _words(rng, 30) for i in range(docs)]
        pq.write_table(pa.table({"text": texts, "id": list(range(docs))}),
                       root / f"part-{s:03d}.parquet", row_group_size=16)
    with open(root / "more.jsonl", "w") as f:
        for i in range(docs):
            f.write(json.dumps({"text": f"json {i}: " + _words(rng, 20)}) + "\n")
    (root / "notes.txt").write_text("a whole text file is one document. " * 20)
    return root
