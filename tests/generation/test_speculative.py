"""Speculative decoding by prompt lookup (troupe.generation.speculative): the tokens of decoding
without it, greedy and sampled (the counter-based draws), through the native verify step and
the model's own, with the prefix cache, stop strings and max_tokens inside a proposal; the
cache rolled back to what a run without speculation holds."""

import random

import pytest
import torch

from troupe.generation import ContinuousBatcher, SamplingParams
from troupe.generation import speculative
from troupe.generation.decode_layers import _extension
from troupe.generation.prefix_cache import PrefixCache
from troupe.generation.speculative import PromptLookup
from troupe.kernels import small_gemm
from troupe.models import GPT, GPTConfig

LLAMA = dict(positions="rope", norm="rmsnorm", mlp="swiglu", out_bias=False, mlp_bias=False,
             n_kv_head=2)
NATIVE = _extension() is not None and small_gemm.available()


def _model(**kw):
    cfg = dict(vocab_size=61, seq_len=96, n_layer=2, n_head=4, d_model=64)
    return GPT(GPTConfig(**{**cfg, **kw}), seed=5).eval()


def _prompts(n=8, seed=0):
    """Prompts that repeat themselves (a text and its copy begun), as an edit request does."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text = [rng.randrange(61) for _ in range(rng.randrange(6, 16))]
        out.append(text + [0] + text[:rng.randrange(1, 4)])
    return out


def _run(model, prompts, params, **engine):
    e = ContinuousBatcher(model, None, max_batch=4, **engine)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        e.add(str(i), p, sp)
    out, logp = e.run_with_logprobs()
    return out, logp, e


def test_prompt_lookup_proposes_what_followed_the_longest_suffix():
    look = PromptLookup(max_n=3)
    assert look.propose([1, 2, 3, 4, 9, 2, 3], 3) == [4, 9, 2]  # "2 3" seen before: "4 9 2"
    assert look.propose([1, 2, 3, 4, 9, 2, 3, 4, 7, 3, 4], 2) == [7, 3]  # "3 4": the latest
    assert PromptLookup().propose([5, 6, 7], 4) == []
    assert PromptLookup().propose([5, 6, 5], 4) == [6, 5]


@pytest.mark.parametrize("arch", [pytest.param(LLAMA, id="native", marks=pytest.mark.skipif(
    not NATIVE, reason="no C++ compiler")), pytest.param({}, id="python")])
def test_greedy_and_sampled_tokens_are_those_without_speculation(arch):
    model = _model(**arch)
    prompts = _prompts()
    params = [SamplingParams(max_tokens=24, logprobs=0, **(
        {} if i % 2 else dict(temperature=0.9, top_p=0.9, top_k=20, seed=i)))
        for i in range(len(prompts))]
    want, want_logp, _ = _run(model, prompts, params)
    got, got_logp, engine = _run(model, prompts, params, speculate=4)
    assert got == want
    for sid in want:
        assert got_logp[sid] == pytest.approx(want_logp[sid], abs=1e-4)
    stats = engine.speculation
    assert stats["passes"] > 0 and 0 < stats["accepted"] <= stats["proposed"], stats


def test_a_broken_accept_all_rule_is_caught(monkeypatch):
    """Keeping every proposal, whatever the model chooses, changes the tokens: the identity
    above is a test that can fail."""
    model = _model()
    prompts = _prompts()
    params = [SamplingParams(max_tokens=24)] * len(prompts)
    want, _, _ = _run(model, prompts, params)

    def accept_all(seqs, props, logits, greedy, finite, eos_id):
        events, matched = [], []
        for i, (s, p) in enumerate(zip(seqs, props)):
            for t in p or [greedy[0]]:
                s.out.append(t)
                events.append(s.advance(t, eos_id))
            matched.append(len(p))
        return events, matched
    monkeypatch.setattr(speculative, "accept", accept_all)
    got, _, _ = _run(model, prompts, params, speculate=4)
    assert got != want


def test_prefix_cache_stop_strings_and_max_tokens_inside_a_proposal():
    """A byte-level model (its text is its tokens): a stop string or max_tokens that falls
    inside a run of accepted proposals ends the sequence there, as without speculation; with
    the prefix cache, the same tokens again."""
    model = _model(vocab_size=257, **LLAMA)
    text = list(b"the cat sat on the mat; the cat sat on the")
    params = [SamplingParams(max_tokens=n, stop=stop) for n, stop in
              ((7, ()), (30, ("at",)), (30, ()), (3, ()))]
    prompts = [text, text[:30], text[5:], text]
    want, _, _ = _run(model, prompts, params)
    got, _, engine = _run(model, prompts, params, speculate=5)
    assert got == want
    assert [len(got[str(i)]) for i in (0, 3)] == [7, 3]
    cached = PrefixCache(1 << 24)
    got, _, _ = _run(model, prompts, params, speculate=5, prefix_cache=cached)
    assert got == want and cached.hit_rate > 0


@torch.no_grad()
def test_rejected_proposals_leave_the_cache_as_a_run_without_speculation():
    model = _model(**LLAMA)
    prompt = _prompts(1, seed=3)[0]
    plain = ContinuousBatcher(model, None, max_batch=1)
    spec = ContinuousBatcher(model, None, max_batch=1, speculate=4)
    for e in (plain, spec):
        e.add("x", prompt, SamplingParams(max_tokens=40))
    checked = 0
    while spec.has_work():
        spec.step()
        if not spec.active:
            break
        n = len(spec.active[0].out)
        while not plain.active or len(plain.active[0].out) < n:
            plain.step()
        assert spec.slots.host[0] == plain.slots.host[0] == len(prompt) + n - 1
        for a, b in zip(spec.slots.keys(0)[0] + spec.slots.keys(0)[1],
                        plain.slots.keys(0)[0] + plain.slots.keys(0)[1]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        checked += 1
    assert checked > 2 and spec.speculation["accepted"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("quant", [None, "w8a8"])
def test_smollm2_copies_with_the_tokens_it_gives_without_speculation(smollm2, quant):
    """SmolLM2-135M-Instruct asked to repeat and to edit texts (with the prefix cache and a
    stop string): the greedy tokens with speculation are those without, in fewer passes of
    the model; fp32 four at once, W8A8 one at a time (its tokens already depend on what shares
    the batch without speculation: the token-wise INT8 rounding of different kernel paths,
    amplified over 30 layers; benchmarks/RESULTS.md, "Speculative decoding"). A mismatch is
    reported with the top-2 gap of the plain run's logits where the two part."""
    from troupe.compression import quantize_model
    from troupe.data import load_tokenizer
    from troupe.models import from_pretrained
    model, tok = from_pretrained(smollm2).eval(), load_tokenizer(smollm2)
    if quant:
        quantize_model(model, {"*": quant})
    texts = ["The quick brown fox jumps over the lazy dog near the river bank.",
             "Ray actors hold state between calls; tasks do not.",
             "def add(a, b):\n    return a + b\n"]
    prompts = [tok.prompt(f"Repeat exactly:\n\n{t}") for t in texts] + \
              [tok.prompt(f"Write this again in capitals:\n\n{texts[0]}")]
    params = [SamplingParams(max_tokens=32, logprobs=0), SamplingParams(max_tokens=32),
              SamplingParams(max_tokens=32, stop=("b\n",)), SamplingParams(max_tokens=32)]
    runs = {}
    for k in (0, 6):
        engine = ContinuousBatcher(model, tok.eos_id, max_batch=1 if quant else 4,
                                   tokenizer=tok.hf, prefix_cache=PrefixCache(1 << 26),
                                   speculate=k)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add(str(i), p, sp)
        out, steps = {}, 0
        while engine.has_work():
            for ev in engine.step():
                out.setdefault(ev.seq_id, []).append(ev.token)
            steps += 1
        runs[k] = (out, steps, engine.speculation)
    (plain, plain_steps, _), (spec, spec_steps, stats) = runs[0], runs[6]
    gaps = []
    for sid in plain:
        if spec[sid] != plain[sid]:  # where they part: the top-2 gap of the plain run's logits
            at = next(i for i, (a, b) in enumerate(zip(spec[sid], plain[sid])) if a != b)
            ids = torch.tensor([prompts[int(sid)] + plain[sid][:at]])
            with torch.no_grad():
                top = model(ids)[0][0, -1].topk(2).values
            gaps.append(float(top[0] - top[1]))
    assert not gaps, f"tokens parted where the top-2 logits were {min(gaps):.2e} apart"
    assert stats["accepted"] > 0 and spec_steps < plain_steps, (stats, spec_steps, plain_steps)


@pytest.mark.parametrize("draft_seed", [5, 9])  # the target itself, then another model
def test_a_draft_models_proposals_give_the_same_tokens(draft_seed):
    """A draft model (troupe.generation.draft) proposes; the target's tokens are those without
    speculation, greedy and sampled, across joins and leaves (the draft's slots follow the
    engine's). The target as its own draft has every greedy proposal accepted."""
    from troupe.generation.draft import DraftModel
    model = _model(**LLAMA)
    draft = GPT(model.cfg, seed=draft_seed).eval()
    prompts = _prompts(6, seed=1)
    params = [SamplingParams(max_tokens=10 + 3 * i, **({} if i % 2 else dict(
        temperature=0.8, seed=i))) for i in range(len(prompts))]
    want, _, _ = _run(model, prompts, params)
    got, _, engine = _run(model, prompts, params, speculate=3, draft=DraftModel(draft, 4))
    assert got == want
    assert engine.speculation["proposed"] > 0
    if draft_seed == 5:  # greedy rows alone: the draft is the target, every proposal stands
        greedy = [SamplingParams(max_tokens=10 + 3 * i) for i in range(len(prompts))]
        _, _, engine = _run(model, prompts, greedy, speculate=3, draft=DraftModel(draft, 4))
        stats = engine.speculation
        assert stats["accepted"] == stats["proposed"] > 0, stats


def test_rows_under_adapters_speculate_to_their_own_tokens(tmp_path):
    """LoRA adapters applied per row (troupe.models.adapters): a batch mixing two adapters and
    the base, speculating, gives each sequence the tokens it gets without speculation."""
    pytest.importorskip("transformers")
    from tests.models.test_adapters import make_base, write_adapter
    from troupe.models import from_pretrained
    from troupe.models.adapters import Adapters, load_peft
    base_dir = make_base(tmp_path / "llama")
    model = from_pretrained(base_dir).eval()
    adapters = Adapters(model)
    for i in range(2):
        adapter_dir, _ = write_adapter(base_dir, tmp_path / f"a{i}", i)
        adapters.add(load_peft(adapter_dir, model, name=f"a{i}"))
    rng = random.Random(2)
    prompts = []
    for _ in range(6):
        text = [rng.randrange(300) for _ in range(8)]
        prompts.append(text + text[:3])
    params = [SamplingParams(max_tokens=16, adapter=(None, "a0", "a1")[i % 3])
              for i in range(len(prompts))]
    want, _, _ = _run(model, prompts, params, adapters=adapters)
    got, _, engine = _run(model, prompts, params, adapters=adapters, speculate=4)
    assert got == want and engine.speculation["passes"] > 0
