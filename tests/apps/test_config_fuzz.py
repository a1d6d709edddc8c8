"""The config fuzzer: hundreds of recipes drawn over each app's schema (tests/apps/
recipe_space.py) go through validation and the driver-side plan (lengths, data, memory), without
Ray; each is refused in one line (a ConfigError or DataError naming the key) or planned, and a
planned one keeps only what fits the model's context. benchmarks/config_fuzz.py runs drawn
recipes to the end."""

import pytest
from hypothesis import HealthCheck, example, given, settings

from tests.apps.recipe_space import COMPRESS, PRETRAIN, RLHF, SERVE, strategy
from troupe.config import ConfigError, load_config, recipe_path
from troupe.data import ByteTokens
from troupe.errors import DataError
from troupe.pretrain.config import PretrainConfig
from troupe.pretrain.plan import plan as pretrain_plan
from troupe.rlhf.config import RLHFConfig
from troupe.rlhf.driver import STEPS
from troupe.rlhf.plan import plan as rlhf_plan

FUZZ = settings(max_examples=120, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])


def _refused_in_one_line(e: Exception) -> None:
    text = str(e)
    assert text and "\n" not in text and "Traceback" not in text, text


def _planned(cls, recipe, overrides: list[str], plan):
    """(config, plan) of a drawn recipe, or None when it is refused: by the schema (one line
    per bad key, named) or by the plan, in one line (asserted)."""
    try:
        cfg = load_config(cls, recipe, overrides)
        return cfg, plan(cfg)
    except (ConfigError, DataError) as e:
        if not (isinstance(e, ConfigError) and str(e).startswith("invalid config from")):
            _refused_in_one_line(e)
        return None


@FUZZ
@given(strategy(RLHF))
@example(["step3.max_new_tokens=100", "sft.steps=5", "reward.steps=5", "step3.iterations=2",
          "workers=1"])
@example(["algorithm=grpo", "env.function=apps.environments:Calculator"])
@example(["model.gpt.seq_len=8"])
@example(["sft.batch_size=1000000"])
def test_rlhf_recipes_are_refused_in_one_line_or_planned(overrides):
    got = _planned(RLHFConfig, recipe_path("rlhf-sort"), overrides,
                   lambda c: rlhf_plan(c, STEPS))
    if got is None:
        return
    cfg, planned = got
    C, N, d = planned.context, cfg.step3.max_new_tokens, planned.data
    tok = ByteTokens()
    assert all(len(tok.prompt(p)) + N <= C for p in d.eval_prompts[:50])
    if cfg.algo().online and not cfg.env.function:
        assert all(len(tok.prompt(p)) + N <= C for p in d.prompts[:50])
    assert all(len(tok.prompt(p)) + len(tok.encode(r)) + 1 <= C for p, r in d.sft[:50])
    if cfg.env.function:
        assert cfg.env.max_tokens < C and N < C


@FUZZ
@given(strategy(PRETRAIN))
@example(["zero_stage=1", "memory_per_worker=0.002"])
def test_pretraining_recipes_are_refused_in_one_line_or_planned(overrides):
    got = _planned(PretrainConfig, recipe_path("dense-tiny"), overrides, pretrain_plan)
    if got is None:
        return
    cfg, planned = got
    assert cfg.memory_per_worker is None or planned.total <= cfg.memory_per_worker * (1 << 30)
    assert not cfg.curriculum.enabled or cfg.curriculum.min_len <= cfg.model.seq_len


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A served model file (context 128) and a teacher directory (4 blocks, context 64)."""
    from troupe.models import GPT, GPTConfig, save_pretrained
    from troupe.serving.model import save_model
    tmp = tmp_path_factory.mktemp("fuzz-models")
    served = save_model(GPT(GPTConfig(seq_len=128, n_layer=2, n_head=2, d_model=32)),
                        tmp / "m.trp")
    teacher = save_pretrained(GPT(GPTConfig(seq_len=64, n_layer=4, n_head=2, d_model=32,
                                            positions="rope", norm="rmsnorm", mlp="swiglu",
                                            out_bias=False, mlp_bias=False,
                                            tie_embeddings=False)), tmp / "teacher")
    return served, teacher


SMALL = settings(FUZZ, max_examples=60)


@SMALL
@given(overrides=strategy(SERVE))
def test_serving_recipes_are_refused_in_one_line_or_planned(models, overrides):
    from troupe.serving.model import check_source
    from troupe.serving.config import ServeConfig
    served, _ = models
    got = _planned(ServeConfig, None, [f"model.file={served}", *overrides], check_source)
    if got is not None:
        assert got[0].limits.max_tokens < 128


@SMALL
@given(overrides=strategy(COMPRESS))
def test_compression_recipes_are_refused_in_one_line_or_planned(models, overrides):
    from troupe.pretrain.compress import CompressConfig, check_student
    _, teacher = models
    got = _planned(CompressConfig, None, [f"model.pretrained={teacher}", *overrides],
                   check_student)
    if got is not None:
        assert got[0].model.seq_len <= 64


def test_the_schema_refusals_are_one_line_each():
    with pytest.raises(ConfigError) as e:
        load_config(RLHFConfig, recipe_path("rlhf-sort"), ["zero_stage=3", "step3.lora.enabled=true"])
    assert str(e.value).count("\n") == 0 and "zero_stage=3" in str(e.value)
