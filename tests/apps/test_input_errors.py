"""Bad input to the apps exits 2 with one line naming the key or file, before anything starts
(issue 14, item 7)."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


class _app:
    """An app as its ``troupe`` subcommand: ``_app("rlhf").main(argv)``."""

    def __init__(self, name: str):
        self.name = name

    def main(self, argv: list[str]) -> int:
        from troupe.cli import main
        return main([self.name, *argv])


def _exit_code_and_message(capsys, app: str, argv: list[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        code = _app(app).main(argv)
        raise SystemExit(code)
    err = capsys.readouterr().err.strip()
    return e.value.code, err


@pytest.fixture
def bad_files(tmp_path):
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("model:\n  d_model: 64 # \xe9t\xe9\n".encode("latin-1"))
    deep = tmp_path / "deep.yaml"
    deep.write_text("a: " + "[" * 3000 + "]" * 3000 + "\n")
    return {"latin1": latin1, "deep": deep}


@pytest.mark.parametrize("app,argv,names", [
    ("pretrain", ["model.n_head=3"], "n_head=3 must divide d_model"),
    ("pretrain", ["model.d_ff=-5"], "model.d_ff"),
    ("pretrain", ["model.seq_len=1e8"], "model.seq_len"),
    ("pretrain", ["optimizer.lr=.inf"], "optimizer.lr"),
    ("rlhf", ["step3.top_p=0"], "step3.top_p"),
    ("serve", ["quantize.*=w3a3"], "mode 'w3a3' is not one of"),
    ("serve", ["model.checkpoint=s3://bucket/run"], "model.checkpoint="),
])
def test_bad_values_exit_2_naming_the_key(capsys, app, argv, names):
    code, err = _exit_code_and_message(capsys, app, argv)
    assert code == 2 and names in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("which,names", [("latin1", "not UTF-8"), ("deep", "nested too deeply")])
def test_bad_files_exit_2_naming_the_file(capsys, bad_files, which, names):
    code, err = _exit_code_and_message(capsys, "pretrain", ["--config", str(bad_files[which])])
    assert code == 2 and names in err and str(bad_files[which]) in err, err
    assert len(err.splitlines()) == 1


def test_a_manifest_without_files_is_named(tmp_path):
    from troupe.checkpoint import CheckpointError, read_manifest
    (tmp_path / "manifest.json").write_text('{"format": "troupe-checkpoint/1", "step": 3}')
    with pytest.raises(CheckpointError, match="manifest.json: 'files' must list"):
        read_manifest(tmp_path)


def test_a_quantize_pattern_that_matches_nothing_exits_2(capsys, tmp_path):
    from troupe.models import GPT, GPTConfig
    from troupe.serving.model import save_model
    path = tmp_path / "m.trp"
    save_model(GPT(GPTConfig(seq_len=512, n_layer=1, n_head=2, d_model=16)), path)
    recipe = tmp_path / "serve.yaml"
    recipe.write_text(f"model: {{file: {path}, name: m}}\nquantize: {{'*.attnn.*': w8a8}}\n")
    code, err = _exit_code_and_message(capsys, "serve", ["--config", str(recipe)])
    assert code == 2 and "pattern '*.attnn.*' matches no layer" in err, err


@pytest.fixture
def served_file(tmp_path):
    from troupe.models import GPT, GPTConfig
    from troupe.serving.model import save_model
    path = tmp_path / "m.trp"
    save_model(GPT(GPTConfig(seq_len=512, n_layer=1, n_head=2, d_model=16)), path)
    return path


@pytest.mark.parametrize("app,config_cls,default", [
    ("pretrain", "troupe.pretrain.config.PretrainConfig", "moe-tiny.yaml"),
    ("rlhf", "troupe.rlhf.config.RLHFConfig", "rlhf-sort.yaml"),
    ("serve", "troupe.serving.config.ServeConfig", "serve-tiny.yaml")])
def test_print_config_prints_what_would_run_and_starts_nothing(capsys, monkeypatch, tmp_path,
                                                               served_file, app, config_cls,
                                                               default):
    """--print-config: the validated configuration with the overrides applied, as YAML that
    reads back to the same configuration; exit 0 and Ray never started. A bad key still exits
    2 naming it."""
    import importlib

    from troupe.config import load_config
    from troupe.runtime import cluster

    def no_ray(*args, **kwargs):
        raise AssertionError("--print-config started Ray")

    monkeypatch.setattr(cluster, "init", no_ray)
    module, _, name = config_cls.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    overrides = {"pretrain": ["train.steps=3"], "rlhf": ["seed=3"],
                 "serve": [f"model.file={served_file}", "model.checkpoint=null", "port=8123"]}[app]
    with pytest.raises(SystemExit) as e:
        _app(app).main(["--print-config", *overrides])
    assert e.value.code == 0
    recipe = tmp_path / "printed.yaml"
    recipe.write_text(capsys.readouterr().out)
    assert load_config(cls, recipe) == load_config(cls, ROOT / "apps" / "configs" / default,
                                                   overrides)
    code, err = _exit_code_and_message(capsys, app, ["--print-config", "no_such_key=1"])
    assert code == 2 and "no_such_key" in err


@pytest.mark.parametrize("ranks", [-1, "2", 0])
def test_a_manifest_with_a_bad_rank_count_is_named(tmp_path, ranks):
    """roles.trainer of -1 or "2" in a hand-edited manifest: a CheckpointError naming the
    entry (a traceback before)."""
    import json

    from troupe.checkpoint import CheckpointError, read_manifest

    (tmp_path / "manifest.json").write_text(json.dumps(
        {"format": "troupe-checkpoint/1", "step": 1, "roles": {"trainer": ranks}, "files": []}))
    with pytest.raises(CheckpointError, match="roles.trainer must be a positive number"):
        read_manifest(tmp_path)
