"""Configuration: pydantic models loaded from YAML recipes with ``a.b=c`` command-line overrides.

Every component owns a small config class derived from ``Config``; an application config nests
them. Unknown keys are errors, and every error names the dotted key at fault together with what
would have been accepted::

    class TrainConfig(Config):
        lr: float = 1e-3
        optimizer: Literal["adam", "onebit_adam"] = "adam"

    cfg = load_config(TrainConfig, "apps/configs/tiny.yaml", ["lr=3e-4"])
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable, ClassVar, Sequence, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from troupe.errors import DataError, TroupeError, one_line

C = TypeVar("C", bound="Config")


class Config(BaseModel):
    """Base of all troupe configs: unknown keys are rejected, assignments are validated, and
    no number may be infinite or NaN."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False,
                              allow_inf_nan=False)


log = logging.getLogger(__name__)


ZERO = """How a training app lays its trained models over their data-parallel ranks:
zero_stage: 1 partitions the optimizer state (every rank keeps the whole model and its
gradient); 3 partitions parameters and gradients too, block by block (troupe.parallel.zero3:
about 16/W bytes a parameter on each of W ranks, plus the blocks being gathered), with adam,
adamw or lamb; 2 partitions them the same way between steps but keeps each block whole
through a step (from its gather in the forward to the optimizer step): ZeRO-1's bytes, the
gradient's reduce-scatter beside the backward and the parameters' gathers beside the
forward. zero_prefetch: with stages 2 and 3, how many blocks are gathered ahead of the one
computing (with stage 3 each costs one block's weights of memory). memory_per_worker: GiB a
rank may plan to hold (parameters, gradients, optimizer state and, with stages 2 and 3, the
gathered blocks: troupe.parallel.memory); a plan over it is refused before anything is
allocated. Default: the GPU's memory on cuda, no limit on cpu."""


def check_zero_stage(stage: int, optimizers: dict[str, Any]) -> None:
    """ValueError naming the first of ``optimizers`` (section -> OptimizerConfig) that stages
    2 and 3 cannot partition (the 1-bit family keeps whole parameters on every rank)."""
    if stage == 1:
        return
    for where, opt in optimizers.items():
        if opt.name not in ("adam", "adamw", "lamb"):
            raise ValueError(f"zero_stage={stage} partitions adam, adamw and lamb; {where}.name="
                             f"{opt.name!r} keeps whole parameters on every rank (use "
                             "zero_stage=1)")


class AppConfig(Config):
    """Base of the applications' recipes. Every app spells a shared setting the same way, at
    the top level: ``device``, ``precision``, ``seed``, ``out_dir``, ``workers``,
    ``num_gpus``, ``max_restarts``, ``collective_timeout_s`` (how long a collective operation
    waits for its group's other ranks before it fails naming them: a fault, which the failure
    policy retries; a link cut for longer, or a lost node, surfaces so), ``zero_stage``,
    ``zero_prefetch``, ``memory_per_worker`` (where the app has it; the last three: ``ZERO``). ``MOVED`` maps a key's older place
    (dotted) to its name now: a recipe, override or stored config that still uses the old
    place is read as the new key, with one warning naming it; giving both is an error."""

    MOVED: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        return move_keys(cls.MOVED, data)


def move_keys(moved: dict[str, str], data: Any) -> Any:
    """``data`` with each key of ``moved`` (old dotted place -> new top-level name) read as its
    new name, one warning each; a section under both names is merged (a key in both: error)."""
    if not isinstance(data, dict) or not moved:
        return data
    data = dict(data)
    for old, new in moved.items():
        *parents, leaf = old.split(".")
        node: Any = data
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node:
            continue
        node = _copy_path(data, parents)
        value = node.pop(leaf)
        if isinstance(value, dict) and isinstance(data.get(new), dict):
            value = _merge_section(old, value, new, data[new])
        elif new in data:
            raise ValueError(f"{old} and {new} both given: {old} is now {new}; keep only "
                             f"{new}")
        log.warning("config: %s is now %s (read as %s=%s)", old, new, new, value)
        data[new] = value
    return data


def moved_overrides(moved: dict[str, str], overrides: Sequence[str]) -> list[str]:
    """``a.b=c`` overrides with keys in an old place renamed (so that an override by the old
    name still beats the recipe's value under the new one); the same key by both names is an
    error."""
    given = {item.partition("=")[0] for item in overrides}
    out = []
    for item in overrides:
        key, sep, value = item.partition("=")
        for old, new in moved.items():
            if key == old or key.startswith(old + "."):
                renamed = new + key[len(old):]
                if renamed in given:
                    raise ConfigError(f"{key} and {renamed} both given: {old} is now {new}; "
                                      f"keep only {renamed}")
                log.warning("config: %s is now %s (read as %s)", key, renamed, renamed)
                key = renamed
                break
        out.append(key + sep + value)
    return out


def _merge_section(old: str, value: dict, new: str, current: dict) -> dict:
    """A section under its old name merged into the one under its new name (an override
    ``ppo.kl_coef=0.1`` beside a recipe's ``step3:``); a key given in both is an error."""
    out = dict(current)
    for key, v in value.items():
        if isinstance(v, dict) and isinstance(out.get(key), dict):
            out[key] = _merge_section(f"{old}.{key}", v, f"{new}.{key}", out[key])
        elif key in out:
            raise ValueError(f"{old}.{key} and {new}.{key} both given: {old} is now {new}; "
                             f"keep only {new}.{key}")
        else:
            out[key] = v
    return out


def _copy_path(data: dict, parents: list[str]) -> dict:
    """The dict at ``parents`` under ``data``, each dict along the way copied (so that
    moving a key out of a nested section leaves the caller's dict as it was)."""
    node = data
    for part in parents:
        node[part] = dict(node[part])
        node = node[part]
    return node


class ConfigError(ValueError):
    """A config file, key or value is invalid; the message names the source and the key."""


def _allowed_keys(cls: type[BaseModel], path: Sequence[str | int]) -> list[str] | None:
    """The field names of the model found by following ``path`` from ``cls``, if any."""
    model: Any = cls
    for part in path:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return None
        model = field.annotation
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None
    return sorted(model.model_fields)


def _describe(cls: type[BaseModel], err: ValidationError, source: str) -> str:
    """One line per bad key (one line in all for a single one), each naming the key."""
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            allowed = _allowed_keys(cls, e["loc"][:-1])
            msg = f"unknown key; allowed keys here: {', '.join(allowed or [])}"
        lines.append(f"{key}: {msg}" if key else msg)
    if len(lines) == 1:
        return f"invalid config from {source}: {lines[0]}"
    return "\n".join([f"invalid config from {source}:"] + [f"  {line}" for line in lines])


def validate(cls: type[C], data: dict[str, Any], source: str = "config") -> C:
    """Build ``cls`` from a plain dict, raising ConfigError that names each bad key."""
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_describe(cls, e, source)) from None


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping from a file; errors name the file (and line for syntax errors)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: not valid YAML: {getattr(e, 'problem', e)}") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to be a recipe") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    return data


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``a.b=c`` overrides to a nested dict; values are parsed as YAML scalars."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not p for p in key.split(".")):
            raise ConfigError(f"override {item!r} is not of the form key.path=value")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw
        node = data
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                prefix = ".".join(parts[: i + 1])
                raise ConfigError(f"override {item!r}: {prefix} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return data


@contextlib.contextmanager
def errors_reported(out_dir: str | Path | None, app: str, show_traceback: bool = False):
    """The apps' one shape for an error: what escapes the block is printed as one line on
    stderr (``troupe.errors.one_line``: the setting, file, row, rank or role at fault, never a
    worker's remote traceback), its whole traceback is written to ``<out_dir>/error.log``
    (shown instead with the apps' ``--traceback``), and the app exits with status 2 (1 for an
    exception troupe did not expect: a bug to report with that log)."""
    try:
        yield
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:  # noqa: BLE001 -- every error gets the one shape
        text = "".join(traceback.format_exception(e))
        where = Path(out_dir) if out_dir is not None else Path(tempfile.gettempdir())
        log_path = where / ("error.log" if out_dir is not None else f"troupe-{app}-error.log")
        try:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            log_path.write_text(text)
            told = f" (traceback in {log_path})"
        except OSError:
            told = ""
        if show_traceback:
            print(text, file=sys.stderr, end="")
            told = ""
        expected = isinstance(e, (ValueError, FileNotFoundError, TroupeError))
        print(f"error: {one_line(e)}{told}", file=sys.stderr)
        raise SystemExit(2 if expected else 1) from None


def load_app_config(cls: type[C], path: str | Path | None, overrides: Sequence[str],
                    check: Callable[[C], Any] | None = None, print_config: bool = False) -> C:
    """``load_config`` for an app's command line: a bad file, key or value (or what ``check``
    refuses with ConfigError, DataError or FileNotFoundError: the apps' plans of lengths,
    data and memory) is printed to stderr and the app exits with status 2, before anything
    starts. ``print_config`` (the apps' --print-config): print the
    validated configuration as YAML (``dump_config``) and exit 0, before anything starts."""
    try:
        cfg = load_config(cls, path, overrides)
        if check is not None:
            check(cfg)
    except (ConfigError, DataError, FileNotFoundError) as e:
        print(e, file=sys.stderr)
        raise SystemExit(2) from None
    if print_config:
        print(dump_config(cfg), end="")
        raise SystemExit(0)
    return cfg


def dump_config(cfg: Config) -> str:
    """The whole configuration as YAML, every default filled in and the overrides applied, in
    the fields' order: a recipe that ``load_config`` reads back to the same configuration."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def load_config(
    cls: type[C], path: str | Path | None = None, overrides: Sequence[str] = ()
) -> C:
    """Load ``cls`` from an optional YAML file plus ``a.b=c`` overrides, validated together."""
    data = read_yaml(path) if path is not None else {}
    moved = getattr(cls, "MOVED", {})
    try:
        data = move_keys(moved, data)
    except ValueError as e:
        raise ConfigError(f"invalid config from {path}: {e}") from None
    data = apply_overrides(data, moved_overrides(moved, overrides))
    source = str(path) if path is not None else "defaults"
    if overrides:
        source += " with overrides " + " ".join(overrides)
    return validate(cls, data, source)


# ---- recipes on the command line ----------------------------------------------------------
_HERE = Path(__file__).resolve().parent
# the bundled recipes: apps/configs in a checkout, troupe/recipes in an installed wheel
RECIPE_DIRS = (_HERE.parent / "apps" / "configs", _HERE / "recipes")


def bundled_recipes() -> dict[str, Path]:
    """Every bundled recipe by name (its file name without .yaml)."""
    found: dict[str, Path] = {}
    for directory in reversed(RECIPE_DIRS):
        found.update({p.stem: p for p in sorted(directory.glob("*.yaml"))})
    return dict(sorted(found.items()))


def recipe_path(value: str) -> str:
    """``--config``'s file: the path as given when it exists; else the bundled recipe of that
    name (``rlhf-sort``, or ``apps/configs/rlhf-sort.yaml`` run outside a checkout, as a job
    whose working directory is elsewhere does); else the path as given, which the config
    loader then reports as missing."""
    if Path(value).expanduser().is_file():
        return value
    name = Path(value).name.removesuffix(".yaml")
    path = bundled_recipes().get(name)
    in_configs = Path(value).parent in (Path("."), Path("apps/configs"))
    return str(path) if path is not None and in_configs else value


def app_parser(app: str, doc: str, default_recipe: str) -> argparse.ArgumentParser:
    """The argument parser every app starts from: --config, --print-config, overrides."""
    p = argparse.ArgumentParser(prog=f"troupe {app}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=default_recipe, type=recipe_path,
                   help=f"YAML recipe: a file, or a bundled recipe's name (default: "
                        f"{default_recipe}; `troupe recipes` lists them)")
    p.add_argument("--print-config", action="store_true",
                   help="print the validated configuration (overrides applied) and exit")
    p.add_argument("--traceback", action="store_true",
                   help="on an error, print its whole traceback (else it goes to "
                        "<out_dir>/error.log and one line says what is wrong)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. device=cpu seed=1")
    return p
