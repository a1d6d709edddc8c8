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


def _run(model, prompts, params, max_batch=4, **engine):
    e = ContinuousBatcher(model, None, max_batch=max_batch, **engine)
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


def _accept_all(seqs, props, logits, greedy, finite, eos_id):
    """A broken acceptance rule: every proposal kept, whatever the model chooses."""
    events, matched = [], []
    for s, p in zip(seqs, props):
        for t in p or [greedy[0]]:
            s.out.append(t)
            events.append(s.advance(t, eos_id))
        matched.append(len(p))
    return events, matched


def test_a_broken_accept_all_rule_is_caught(monkeypatch):
    """Keeping every proposal, whatever the model chooses, changes the tokens: the identity
    above is a test that can fail."""
    model = _model()
    prompts = _prompts()
    params = [SamplingParams(max_tokens=24)] * len(prompts)
    want, _, _ = _run(model, prompts, params)
    monkeypatch.setattr(speculative, "accept", _accept_all)
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


def _nucleus(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The distribution a draw should follow: the tempered softmax, cut to the likeliest tokens
    whose mass before each is under ``top_p`` (the first always kept), renormalized."""
    probs = torch.softmax(logits.double() / temperature, -1)
    if top_p < 1.0:
        sorted_, order = probs.sort(descending=True)
        cut = torch.zeros_like(probs)
        keep = (sorted_.cumsum(0) - sorted_) < top_p
        cut[order[keep]] = sorted_[keep]
        probs = cut / cut.sum()
    return probs


def _chi_square(model, prompt, rows, temperature, top_p, **engine) -> tuple[float, float, dict]:
    """Pearson's statistic of the second and third sampled tokens of ``rows`` sequences (a
    seed each, 8 at a time: the first comes from the prefill, the next two from a speculative
    step, its proposal kept or not) against the model's exact joint distribution
    sum over t1 of p(t1) p(t2 | t1) p(t3 | t1 t2); the 0.1% critical value for its degrees of
    freedom (Wilson and Hilferty's approximation); the engine's speculation counts."""
    sp = [SamplingParams(max_tokens=3, temperature=temperature, top_p=top_p, seed=1000 + i)
          for i in range(rows)]
    got, _, e = _run(model, [prompt] * rows, sp, max_batch=8, **engine)
    with torch.no_grad():
        def dist(prefixes):  # the next token's distribution after each prefix, (N, V)
            logits = model(torch.tensor([prompt + p for p in prefixes]))[0][:, -1]
            return torch.stack([_nucleus(x, temperature, top_p) for x in logits])
        V = model.cfg.vocab_size
        first = dist([[]])[0]
        second = dist([[a] for a in range(V)])                               # [t1, t2]
        third = dist([[a, b] for a in range(V) for b in range(V)]).view(V, V, V)
        expect = (first[:, None, None] * second[:, :, None] * third).sum(0) * rows
    seen = torch.zeros(V, V, dtype=torch.float64)
    for out in got.values():
        seen[out[1], out[2]] += 1
    assert not bool((seen[expect == 0] > 0).any()), "a token the sampler must never draw"
    cells = expect > 0
    stat = float(((seen[cells] - expect[cells]) ** 2 / expect[cells]).sum())
    dof = int(cells.sum()) - 1
    z = 3.09  # the 99.9th percentile of the standard normal
    return stat, dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3, e.speculation


@pytest.mark.parametrize("temperature,top_p", [(0.7, 1.0), (1.0, 1.0), (1.0, 0.9)])
def test_sampled_frequencies_follow_the_target_model(monkeypatch, temperature, top_p):
    """Speculating from a prompt that repeats itself (lookup proposes at every step), the
    second and third tokens of 3,000 seeded sequences follow the model's own tempered, top-p cut
    distribution (chi-square at 0.1%, on a 6-token vocabulary); the server and the rollouts
    draw through this engine. An accept-all rule, which keeps proposals whatever the model
    says, fails the same test on a third of the sequences (its statistic grows with their
    number: 1,960 to 3,022 at 3,000, against a critical value near 66)."""
    model = _model(vocab_size=6, **LLAMA)
    prompt, rows = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], 3000
    stat, critical, spec = _chi_square(model, prompt, rows, temperature, top_p, speculate=3,
                                       speculate_batch=8)
    assert stat < critical, (stat, critical)
    assert spec["passes"] > rows / 16 and 0 < spec["accepted"] < spec["proposed"], spec
    monkeypatch.setattr(speculative, "accept", _accept_all)
    broken, _, _ = _chi_square(model, prompt, rows // 3, temperature, top_p, speculate=3,
                               speculate_batch=8)
    assert broken > critical, (broken, critical)


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
