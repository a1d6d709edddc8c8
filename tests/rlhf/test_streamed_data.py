"""RLHF from a directory of parquet shards (troupe.rlhf.data.datasets.streamed_data): rows read
when a step draws them, held out by their prompt's hash, held to the context by lengths the
shards' tasks measured; SFT, the reward model and step 3 run on them."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from troupe.errors import DataError
from troupe.rlhf.config import RLHFConfig
from troupe.rlhf.data.datasets import RowView, SortTask
from troupe.rlhf.plan import plan


def write_shards(root, n=240, shards=3, seed=5):
    """The bundled task's preference pairs as parquet shards (a reward-function field too)."""
    task = SortTask()
    rows = task.preferences(n, seed)
    root.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        part = rows[s::shards]
        pq.write_table(pa.table({"prompt": [e.prompt for e in part],
                                 "chosen": [e.chosen for e in part],
                                 "rejected": [e.rejected for e in part],
                                 "source": [f"shard {s}"] * len(part)}),
                       root / f"pairs-{s}.parquet", row_group_size=32)
    return root, rows


def _cfg(tmp_path, path, name="run", **over) -> RLHFConfig:
    base = dict(model=dict(gpt=dict(seq_len=48, n_layer=2, n_head=2, d_model=32)),
                data=dict(path=str(path), eval_fraction=0.1),
                sft=dict(steps=6, batch_size=8), reward=dict(steps=6, batch_size=8),
                step3=dict(iterations=2, prompts_per_iter=8, max_new_tokens=6, eval_every=2,
                           checkpoint_every=1),
                workers=2, out_dir=str(tmp_path / name))
    base.update(over)
    return RLHFConfig(**base)


def test_the_plan_views_the_rows_it_holds_to_the_context(cluster, tmp_path):
    root, rows = write_shards(tmp_path / "shards")
    p = plan(_cfg(tmp_path, root), ("sft", "reward", "step3"))
    d = p.data
    assert all(isinstance(x, RowView) for x in (d.sft, d.pairs, d.prompts, d.eval_prompts))
    assert len(d.prompts) + len(d.eval_prompts) + p.skipped["prompts"] + \
        p.skipped["eval_prompts"] == len(rows)
    assert 0 < len(d.eval_prompts) < len(rows) * 0.25
    prompts = {e.prompt for e in rows}
    assert all(d.prompts[i] in prompts for i in range(len(d.prompts)))
    prompt, chosen, rejected = d.pairs[3]
    assert any(e.prompt == prompt and e.chosen == chosen and e.rejected == rejected
               for e in rows)
    assert d.fields[0] == {"source": d.fields[0]["source"]} and "shard" in d.fields[0]["source"]
    again = plan(_cfg(tmp_path, root), ("sft",)).data  # the split is the rows' own
    assert list(again.eval_prompts.ids) == list(d.eval_prompts.ids)


def test_a_bad_row_is_named(cluster, tmp_path):
    root, _ = write_shards(tmp_path / "shards")
    pq.write_table(pa.table({"prompt": ["fine", None], "chosen": ["a", "b"],
                             "rejected": ["c", "d"]}), root / "pairs-9.parquet")
    with pytest.raises(DataError, match=r"pairs-9.parquet: row 2: field prompt missing"):
        plan(_cfg(tmp_path, root), ("sft",))


def test_sft_reward_and_step3_run_on_streamed_rows(rlhf_graphs, tmp_path):
    root, _ = write_shards(tmp_path / "shards")
    rlhf_graphs.run(_cfg(tmp_path, root, sft=dict(steps=3, batch_size=8),
                         reward=dict(steps=3, batch_size=8),
                         step3=dict(iterations=1, prompts_per_iter=8, max_new_tokens=6,
                                    eval_every=1, checkpoint_every=1)))
    records = [json.loads(line) for line in
               (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    kinds = {r["kind"] for r in records}
    assert {"sft", "reward", "step3"} <= kinds
    assert np.isfinite([r["loss"] for r in records if r["kind"] == "sft"]).all()
