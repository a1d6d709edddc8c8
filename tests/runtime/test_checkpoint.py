"""A checkpoint whose write is interrupted midway is never loaded: the previous one is (in a
local directory and behind an fsspec URL)."""

import os
from pathlib import Path

import fsspec
import pytest
import ray
import torch

from troupe import checkpoint as ckpt
from troupe.checkpoint import storage
from troupe.errors import WorkerDiedError
from troupe.runtime import ActorGraph, checkpoint, get_context

pytestmark = pytest.mark.waits  # one process writing and reading


class Saver:
    """Holds one tensor; ``crash_in_save`` makes rank 1 die halfway through writing its file."""

    def __init__(self):
        self.value = torch.zeros(1000)
        self.crash_in_save = False

    def set(self, v, crash_in_save=False):
        self.value.fill_(v)
        self.crash_in_save = crash_in_save

    def get(self):
        return self.value[0].item()

    def save(self, directory):
        rank = get_context().rank
        if self.crash_in_save and rank == 1:
            path = ckpt.rank_file(directory, rank)
            if storage.is_url(path):  # an upload cut off: the worst case, half an object
                f = fsspec.open(path, "wb").open()
            else:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                f = open(f"{path}.tmp", "wb")
            f.write(b"\0" * 2000)  # half a file, then the process is gone
            f.flush()
            os._exit(1)
        return ckpt.write_rank(directory, rank, {"value": self.value})

    def load(self, directory):
        rank = get_context().rank
        self.value = ckpt.read_rank(directory, rank, ckpt.read_manifest(directory))["value"]


@pytest.mark.parametrize("where", ["local", "url"])
def test_interrupted_save_is_never_loaded(cluster, tmp_path, where):
    # a local directory (staging renamed into place) or an fsspec URL (written in place)
    root = tmp_path if where == "local" else f"file://{tmp_path}"
    incomplete = (tmp_path / ".step-00000002.partial" if where == "local"
                  else f"{root}/step-00000002")
    graph = ActorGraph("ckpt").role("saver", Saver, 2, num_cpus=0.5, max_restarts=1).build(60)
    try:
        savers = graph["saver"]
        savers.invoke(Saver.set, 1.0)
        first = checkpoint.save([savers], root, step=1)
        savers.invoke(Saver.set, 2.0, crash_in_save=True)
        with pytest.raises(WorkerDiedError) as e:
            checkpoint.save([savers], root, step=2)
        assert e.value.rank == 1
        assert checkpoint.latest(root) == first
        assert where == "url" or not (tmp_path / "step-00000002").exists()
        with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
            checkpoint.restore([savers], incomplete)
        savers.wait_ready(60)  # rank 1 restarted with a fresh state
        savers.invoke(Saver.set, 7.0)
        assert checkpoint.restore([savers], checkpoint.latest(root)) == 1
        assert savers.invoke(Saver.get) == [1.0, 1.0]
        savers.invoke(Saver.set, 3.0)  # the same step saved again after the restart
        assert checkpoint.save([savers], root, step=2) == storage.join(root, "step-00000002")
        assert not (tmp_path / ".step-00000002.partial").exists()
        savers.invoke(Saver.set, 0.0)
        assert checkpoint.restore([savers], checkpoint.latest(root)) == 2
        assert savers.invoke(Saver.get) == [3.0, 3.0]
        for step in (3, 4):  # the newest two are kept
            checkpoint.save([savers], root, step=step)
        assert [storage.name(d) for d in ckpt.steps(root)] == ["step-00000003", "step-00000004"]
    finally:
        graph.shutdown()
    ray.util.placement_group_table()  # the cluster still answers
