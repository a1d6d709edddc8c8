"""A recipe that validates runs: the failures a new user met after ``--print-config`` accepted
their recipe are refused before Ray starts, in one line naming the key and both numbers; what
only the data decides is skipped and counted; an error raised by code reaches the terminal as
one line (its traceback in <out_dir>/error.log), a worker's error ends the run at once."""

import json

import pytest
import torch

from troupe.cli import main
from troupe.config import errors_reported, load_config, recipe_path
from troupe.errors import WorkerCallError
from troupe.models import GPT, GPTConfig
from troupe.rlhf.config import RLHFConfig
from troupe.rlhf.plan import plan
from troupe.runtime import cluster


@pytest.fixture
def no_ray(monkeypatch):
    """Fails the test if the app starts Ray."""
    def started(*args, **kwargs):
        raise AssertionError("Ray was started")
    monkeypatch.setattr(cluster, "init", started)


def _refusal(capsys, argv: list[str]) -> str:
    """The one line an app prints on stderr when it exits 2, asserted to be one line."""
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main(argv))
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    return err


# the four cases of the issue, as a user typed them ------------------------------------------
def test_new_tokens_past_the_context_are_refused_naming_both_numbers(capsys, no_ray):
    err = _refusal(capsys, ["rlhf", "step3.max_new_tokens=100", "sft.steps=5", "reward.steps=5",
                            "step3.iterations=2", "workers=1"])
    assert err == ("step3.max_new_tokens=100 plus the shortest prompt of the task (9 tokens) "
                   "exceed the model's context of 32 tokens (model.gpt.seq_len): at most 23 new "
                   "tokens fit"), err


def test_an_environment_budget_past_the_context_is_refused(capsys, no_ray):
    err = _refusal(capsys, ["rlhf", "algorithm=grpo",
                            "env.function=apps.environments:Calculator"])
    assert err == ("env.max_tokens=256 does not fit the model's context of 32 tokens "
                   "(model.gpt.seq_len) after an opening of at least one token: set it "
                   "below 32"), err


def test_a_memory_budget_is_refused_on_the_driver(capsys, no_ray):
    err = _refusal(capsys, ["pretrain", "--config", "apps/configs/dense-tiny.yaml",
                            "zero_stage=1", "memory_per_worker=0.002"])
    assert err.startswith("every rank of 2: zero_stage 1 plans 9.6 MiB (parameters 3.2 MiB, "
                          "gradients 3.2 MiB, optimizer state 3.2 MiB) a worker, over "
                          "memory_per_worker=0.002 GiB; zero_stage 3 would plan"), err


@pytest.mark.parametrize("override,line", [
    ("model.gpt.seq_len=8", "sft: no demonstration of the task fits the model's context of 8 "
                            "tokens (model.gpt.seq_len): the shortest has 12 tokens"),
    ("sft.batch_size=1000000", "sft.batch_size=1000000, but the task holds 20000 training "
                               "demonstrations (after data.eval_fraction): lower "
                               "sft.batch_size or give more rows"),
])
def test_a_context_shorter_than_the_data_and_a_batch_larger_than_it(capsys, no_ray, override,
                                                                   line):
    assert _refusal(capsys, ["rlhf", override, "--print-config"]) == line


def test_the_servers_limit_is_held_against_the_context(capsys, no_ray, tmp_path):
    from troupe.serving.model import save_model
    path = tmp_path / "m.trp"
    save_model(GPT(GPTConfig(seq_len=48, n_layer=1, n_head=2, d_model=16)), path)
    err = _refusal(capsys, ["serve", f"model.file={path}", "model.checkpoint=null",
                            "quantize={}", "limits.max_tokens=64", "--print-config"])
    assert err == (f"limits.max_tokens=64 leaves no room for a prompt in the model's context "
                   f"of 48 tokens (model.file {path}): set it below 48"), err


def test_a_distillation_window_past_the_teachers_context_is_refused(capsys, no_ray, tmp_path):
    from troupe.models import save_pretrained
    teacher = save_pretrained(GPT(GPTConfig(seq_len=64, n_layer=2, n_head=2, d_model=32,
                                            positions="rope", norm="rmsnorm", mlp="swiglu",
                                            out_bias=False, mlp_bias=False,
                                            tie_embeddings=False)), tmp_path / "teacher")
    err = _refusal(capsys, ["compress", f"model.pretrained={teacher}", "model.seq_len=128",
                            "--print-config"])
    assert err == (f"model.seq_len=128 (the training window) exceeds the model's context of "
                   f"64 tokens ({teacher}/config.json max_position_embeddings)"), err


# what only the data decides ----------------------------------------------------------------
def test_prompts_longer_than_the_context_are_skipped_before_the_split(tmp_path):
    """Rows whose prompt plus max_new_tokens exceed the context are dropped on the driver
    (every rank draws from what is left), and counted in the plan's record."""
    rows = [{"prompt": "sort " + "9" * n + ":", "chosen": "9" * n, "rejected": "1"}
            for n in [3, 30, 4, 5, 40, 3, 6, 4, 5, 40] * 4]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(RLHFConfig, recipe_path("rlhf-sort"),
                      [f"data.path={path}", "sft.batch_size=4", "reward.batch_size=4",
                       "step3.prompts_per_iter=2", "data.eval_fraction=0.1"])
    planned = plan(cfg, ("sft", "reward", "step3"))
    record = planned.record()
    assert all(len(p) + 8 <= 32 for p in planned.data.prompts + planned.data.eval_prompts)
    assert record["skipped"] == {"demonstrations": 11, "pairs": 11, "eval_pairs": 1,
                                 "prompts": 11, "eval_prompts": 1}
    assert len(planned.data.prompts) == 36 - 11
    assert set(record["memory_bytes"]) == {"policy (sft)", "reward", "policy", "critic"}
    params = sum(p.numel() for p in GPT(cfg.model.gpt).parameters())
    assert record["memory_bytes"]["policy"]["params"] == 4 * params


def test_a_padded_batch_wider_than_the_context_runs_when_every_row_fits():
    """Rollouts lay prompts and responses out in columns of their own, so a batch can be
    wider than the context where no row is: each row's logits are those of the row alone."""
    model = GPT(GPTConfig(vocab_size=257, seq_len=12, n_layer=2, n_head=2, d_model=32), seed=0)
    a, b = torch.arange(1, 11), torch.arange(20, 26)  # 10 and 6 tokens
    ids = torch.zeros(2, 16, dtype=torch.long)
    valid = torch.zeros(2, 16, dtype=torch.bool)
    ids[0, :10], valid[0, :10] = a, True          # the first row on the left ...
    ids[1, 10:], valid[1, 10:] = b, True          # ... the second on the right: width 16 > 12
    h, _ = model.hidden(ids, valid_BS=valid)
    torch.testing.assert_close(h[0, :10], model.hidden(a[None])[0][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h[1, 10:], model.hidden(b[None])[0][0], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="sequence of 13 tokens exceeds seq_len=12"):
        model.hidden(torch.arange(1, 14)[None])


# one shape for an error --------------------------------------------------------------------
def test_a_workers_error_is_one_line_and_its_traceback_goes_to_error_log(capsys, tmp_path):
    remote = ("ray::RoleWorker.call() (pid=1, ip=198.18.0.2)\n  File \"x.py\", line 3, in f\n"
              "    raise ValueError(...)\nValueError: sequence of 77 tokens exceeds seq_len=32")
    with pytest.raises(SystemExit) as e:
        with errors_reported(tmp_path / "run", "rlhf"):
            raise WorkerCallError("reference", 0, "n1", "reference_logprobs", remote)
    err = capsys.readouterr().err.strip()
    log = tmp_path / "run" / "error.log"
    assert e.value.code == 2 and err == (
        "error: role 'reference' rank 0 on node n1 raised in reference_logprobs(): ValueError: "
        f"sequence of 77 tokens exceeds seq_len=32 (traceback in {log})")
    assert "ray::RoleWorker.call()" in log.read_text()
    with pytest.raises(SystemExit) as e:
        with errors_reported(tmp_path / "run", "rlhf"):
            {}["a bug"]
    assert e.value.code == 1 and capsys.readouterr().err.startswith("error: KeyError: 'a bug'")



def test_the_main_jobs_ending_reads_at_a_glance():
    from troupe.rlhf.cli import glance
    summary = {"algorithm": "ppo", "steps": ["sft", "reward", "step3"], "seconds": 83.4,
               "sft": {"gold": 0.512, "exact": 0.25, "samples": [["sort 12:", "12"]] * 4},
               "reward_accuracy": 0.9375,
               "step3": {"before": {"gold": 0.512}, "after": {"gold": 0.781, "exact": 0.5}},
               "exported": "runs/x/policy-hf"}
    cfg = load_config(RLHFConfig, None, ["out_dir=runs/x"])
    assert glance(summary, cfg).splitlines() == [
        "rlhf (ppo): sft, reward, step3 in 83 s",
        "  after SFT:           gold 0.512, exact 0.250",
        "  after ppo:           gold 0.781, exact 0.500",
        "  reward model:        accuracy 0.938 on held-out pairs",
        "  plots:               runs/x/rlhf.png",
        "  exported model:      runs/x/policy-hf",
        "  everything else:     runs/x/summary.json, runs/x/metrics.jsonl"]


def test_a_worker_exception_whose_message_goes_on_is_named_by_its_first_line():
    """A CollectiveTimeoutError carries the ranks' stacks after its first line: the failure
    record and the one line name the exception, not the last line of a stack."""
    from troupe.errors import CollectiveTimeoutError, failure_record, one_line
    cause = CollectiveTimeoutError("dp", [1], 2, 5.0, "finish allreduce",
                                   stacks={1: "in flight: train_step\nthread MainThread:"})
    e = WorkerCallError("trainer", 0, "n1", "train_step", f"traceback\n{cause}", cause)
    assert failure_record(e)["cause"].startswith("raised in train_step(): "
                                                 "CollectiveTimeoutError: group 'dp'")
    assert "within 5s" in one_line(e) and "thread MainThread" not in one_line(e)
