"""What a checkpoint records about its model: one typed object that every loader reads the same
way (resuming a run, exporting, serving, starting RLHF from it).

A pretraining recipe's ``model`` section says how to *get* a model (a shape, or a Hugging Face
directory to start from); the record says what the model *is*: the architecture it was built
with, resolved, and where its tokenizer comes from. It carries a SHA-256 of the architecture,
so a hand-edited manifest (another ``n_head`` with the same tensor shapes would load silently
and compute something else) is refused::

    record = ModelRecord.of(arch, tokenizer=cfg.model.pretrained)
    manifest["model"] = record.to_json()
    ...
    record = ModelRecord.read(manifest["model"], "runs/x/checkpoints/step-00000100")
    model = GPT(record.architecture)
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from troupe.checkpoint import CheckpointError
from troupe.config import Config, ConfigError, validate
from troupe.models.gpt import GPTConfig


# GPTConfig's fields added after checkpoints began to carry records, with their defaults: in
# the hash only when set otherwise, so that a checkpoint written before them keeps its hash
# (and is still read)
LATER_FIELDS = {"head_dim": None, "sliding_window": None, "sliding_layers": None,
                "qk_norm": False}


def architecture_hash(arch: GPTConfig) -> str:
    """SHA-256 of the architecture's canonical JSON (sorted keys, defaults filled in, apart
    from LATER_FIELDS at their defaults)."""
    fields = arch.model_dump(mode="json")
    for key, default in LATER_FIELDS.items():
        if fields[key] == default:
            del fields[key]
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


class ModelRecord(Config):
    """architecture: the configuration the model was built with. tokenizer: the Hugging Face
    directory whose tokenizer the model reads (None: troupe's byte tokenizer). sha256: the
    architecture's hash (``architecture_hash``), checked on reading."""

    architecture: GPTConfig
    tokenizer: str | None = None
    sha256: str

    @classmethod
    def of(cls, arch: GPTConfig, tokenizer: str | None = None) -> "ModelRecord":
        return cls(architecture=arch, tokenizer=tokenizer, sha256=architecture_hash(arch))

    @classmethod
    def read(cls, data: Any, source: str) -> "ModelRecord":
        """The record in ``data`` (a manifest's "model" entry); ConfigError naming ``source``
        when it is malformed or its architecture does not match its hash."""
        record = validate(cls, data, f"{source}: model record")
        if architecture_hash(record.architecture) != record.sha256:
            raise ConfigError(f"{source}: the model record's architecture does not match its "
                              "sha256 (edited by hand?); refusing to build a model from it")
        return record

    @classmethod
    def in_manifest(cls, manifest: dict, directory: Any) -> "ModelRecord | None":
        """The record a checkpoint's manifest carries (None for one written before manifests
        carried it); CheckpointError naming the checkpoint when it is malformed or edited."""
        if "model" not in manifest:
            return None
        try:
            return cls.read(manifest["model"], str(directory))
        except ConfigError as e:
            raise CheckpointError(str(e)) from None

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def differences(self, other: "ModelRecord") -> list[str]:
        """``key=mine vs theirs`` for each architecture field the two disagree on."""
        a, b = self.architecture.model_dump(), other.architecture.model_dump()
        return [f"{k}={a[k]!r} vs {b[k]!r}" for k in a if a[k] != b.get(k)]
