"""Persistence without Ray: sharded checkpoints (one wire-format file per rank and a manifest
written last) on local paths or fsspec URLs. The driver half, which asks every rank of a graph
to write its file, is troupe.runtime.checkpoint; model files (one module's weights) are
troupe.models.io."""

from troupe.checkpoint import storage
from troupe.checkpoint.sharded import (
    FORMAT,
    MANIFEST,
    CheckpointError,
    check_file,
    latest,
    rank_file,
    read_manifest,
    read_rank,
    steps,
    write_manifest,
    write_rank,
)
from troupe.checkpoint.storage import StorePath

__all__ = ["FORMAT", "MANIFEST", "CheckpointError", "StorePath", "check_file", "latest",
           "rank_file", "read_manifest", "read_rank", "steps", "storage", "write_manifest",
           "write_rank"]
