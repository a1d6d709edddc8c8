"""Rows of a directory (glob, URL) of parquet and jsonl shards, numbered across the shards
and read when asked for: the RLHF rows that are larger than memory
(troupe.rlhf.data.datasets.streamed_data)."""

from __future__ import annotations

import json

import numpy as np

from troupe.data.stream import list_shards
from troupe.errors import DataError


class Rows:
    """The rows of a directory (glob, URL) of parquet and jsonl shards, numbered across the
    shards in order, each read when asked for (``rows[g]``: the row as a dict and where it
    is, "file row n"): parquet through the file's row groups (a few kept decoded), jsonl
    through each line's offset (found once, 8 bytes a row). For row sets larger than memory
    (RLHF's prompts, demonstrations and pairs: troupe.rlhf.data.datasets)."""

    GROUPS_KEPT = 4

    def __init__(self, files: list[str], layouts: list[np.ndarray] | None = None):
        """The rows of ``files``; ``layouts``: each file's ``index`` when it was found
        already (by the tasks that read the files), else found here."""
        self.files = files
        # per file: its row groups' first rows, or its lines' offsets
        self._layout = layouts if layouts is not None else [self.index(f) for f in files]
        self.counts = [int(x[-1]) for x in self._layout]
        self.starts = np.cumsum([0] + self.counts)
        self._groups: dict[tuple[int, int], list] = {}

    @staticmethod
    def shards(source: str) -> list[str]:
        """The parquet and jsonl shards of ``source`` (troupe.data.stream.list_shards)."""
        files = [f for f in list_shards(source) if not f.endswith(".txt")]
        if not files:
            raise DataError(f"{source}: no .parquet or .jsonl shards of rows")
        return files

    @staticmethod
    def index(path: str) -> np.ndarray:
        """A parquet file's row-group boundaries, or a jsonl file's line offsets (with its
        size last): both end with the file's row count's boundary."""
        import fsspec
        with fsspec.open(path, "rb") as f:
            if path.endswith(".parquet"):
                import pyarrow.parquet as pq
                try:
                    meta = pq.ParquetFile(f).metadata
                except Exception as e:
                    raise DataError(f"{path}: not a readable parquet file "
                                    f"({type(e).__name__}: {e})") from None
                sizes = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
                return np.cumsum([0] + sizes)
            offsets, pos = [], 0
            for line in f:
                if line.strip():
                    offsets.append(pos)
                pos += len(line)
            return np.asarray(offsets + [pos], dtype=np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def shard_of(self, g: int) -> tuple[int, int]:
        """(file index, row within the file) of global row ``g``."""
        f = int(np.searchsorted(self.starts, g, side="right")) - 1
        return f, g - int(self.starts[f])

    def __getitem__(self, g: int) -> tuple[dict, str]:
        f, r = self.shard_of(int(g))
        path, layout = self.files[f], self._layout[f]
        if path.endswith(".jsonl"):
            import fsspec
            with fsspec.open(path, "rb") as fh:
                fh.seek(int(layout[r]))
                line = fh.readline()
            where = f"{path}: row {r + 1}"
            try:
                row = json.loads(line)
            except (ValueError, UnicodeDecodeError) as e:
                raise DataError(f"{where}: not a JSON object ({type(e).__name__})") from None
            if not isinstance(row, dict):
                raise DataError(f"{where}: not a JSON object")
            return row, where
        group = int(np.searchsorted(layout, r, side="right")) - 1
        key = (f, group)
        if key not in self._groups:
            if len(self._groups) >= self.GROUPS_KEPT:
                self._groups.pop(next(iter(self._groups)))
            import fsspec
            import pyarrow.parquet as pq
            with fsspec.open(path, "rb") as fh:
                self._groups[key] = pq.ParquetFile(fh).read_row_group(group).to_pylist()
        row = self._groups[key][r - int(layout[group])]
        return {k: v for k, v in row.items() if v is not None}, f"{path}: row {r + 1}"

    def __getstate__(self):
        return {**self.__dict__, "_groups": {}}
