"""Continuous batching gives each sequence the tokens it would get alone."""

import random

import pytest
import torch

from troupe.compression import quantize_model
from troupe.generation import ContinuousBatcher, SamplingParams
from troupe.models import GPT, GPTConfig

EOS = 256


def tiny(seed=0, quant=None):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=257, seq_len=64, n_layer=2, n_head=2, d_model=32), seed=seed)
    if quant:
        quantize_model(model, {"*": quant}, group_size=16)
    return model.eval()


@torch.no_grad()
def alone(model, prompt, n):
    """Greedy decoding of one sequence without a cache: the reference."""
    ids = list(prompt)
    out = []
    for _ in range(n):
        logits, _, _ = model(torch.tensor([ids]))
        t = int(logits[0, -1].argmax())
        out.append(t)
        if t == EOS:
            break
        ids.append(t)
    return out


def run(engine, steps_between=None):
    """Drive the engine until idle; returns seq_id -> tokens."""
    out = {}
    pending = dict(steps_between or {})
    step = 0
    while engine.has_work() or pending:
        for sid, (at, prompt, params) in list(pending.items()):
            if at <= step:
                engine.add(sid, prompt, params)
                del pending[sid]
        for ev in engine.step():
            out.setdefault(ev.seq_id, []).append(ev.token)
        step += 1
    return out


@pytest.mark.parametrize("quant", [None, "w8a8"])
def test_sequences_joining_midway_match_decoding_alone(quant):
    model = tiny(quant=quant)
    rng = random.Random(0)
    reqs = {}
    for i in range(10):
        prompt = [rng.randrange(256) for _ in range(rng.randrange(1, 20))]
        params = SamplingParams(max_tokens=rng.randrange(1, 30))
        reqs[f"r{i}"] = (rng.randrange(0, 12), prompt, params)
    engine = ContinuousBatcher(model, EOS, max_batch=4)
    got = run(engine, reqs)
    for sid, (_, prompt, params) in reqs.items():
        assert got[sid] == alone(model, prompt, params.max_tokens), sid


def test_long_run_compacts_the_cache():
    model = tiny()
    engine = ContinuousBatcher(model, EOS, max_batch=2)
    reqs = {f"r{i}": (i * 15, [1 + i, 2, 3], SamplingParams(max_tokens=40)) for i in range(5)}
    got = run(engine, reqs)
    for sid, (_, prompt, params) in reqs.items():
        assert got[sid] == alone(model, prompt, params.max_tokens)


def test_stop_strings_limits_and_text():
    model = tiny()
    engine = ContinuousBatcher(model, EOS)
    ref = alone(model, [65, 66], 12)
    text = bytes(t for t in ref if t < 256).decode("utf-8", "replace")
    engine.add("a", [65, 66], SamplingParams(max_tokens=12))
    events = []
    while engine.has_work():
        events += engine.step()
    assert "".join(e.delta for e in events) == text
    assert events[-1].finish_reason == ("stop" if ref[-1] == EOS else "length")
    with pytest.raises(ValueError, match="exceed the model's context of 64"):
        engine.add("b", [1] * 60, SamplingParams(max_tokens=5))
    if len(text) > 3 and "\ufffd" not in text:
        stop = text[2:4]
        engine.add("c", [65, 66], SamplingParams(max_tokens=12, stop=(stop,)))
        events = []
        while engine.has_work():
            events += engine.step()
        assert "".join(e.delta for e in events) == text[:text.find(stop)]
        assert events[-1].finish_reason == "stop"


def test_sampling_is_repeatable_with_a_seed_and_cancel_frees_the_slot():
    model = tiny()
    p = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=7)
    runs = []
    for _ in range(2):
        engine = ContinuousBatcher(model, EOS)
        engine.add("s", [5, 6, 7], p)
        runs.append(run(engine)["s"])
    assert runs[0] == runs[1]
    engine = ContinuousBatcher(model, EOS, max_batch=1)
    engine.add("x", [1, 2], SamplingParams(max_tokens=30))
    engine.add("y", [3, 4], SamplingParams(max_tokens=2))
    engine.step()
    engine.cancel("x")
    got = run(engine)
    assert got["y"] == alone(model, [3, 4], 2)


@pytest.mark.gpu
def test_engine_on_cuda_matches_cpu():
    model = tiny(quant="w8a8")
    engine = ContinuousBatcher(model, EOS, max_batch=4)
    reqs = {f"r{i}": (i, [3 + i, 4, 5], SamplingParams(max_tokens=12)) for i in range(4)}
    want = run(engine, reqs)
    gpu = ContinuousBatcher(model.cuda(), EOS, max_batch=4)
    assert run(gpu, reqs) == want


def poisoned(at: int = 40):
    """The tiny model with position ``at``'s embedding NaN: a sequence that reaches it gets
    non-finite logits; shorter ones never touch it."""
    model = tiny()
    with torch.no_grad():
        model.pos_emb.weight[at] = float("nan")
    return model


def test_a_sequence_with_non_finite_logits_ends_alone():
    model = poisoned()
    engine = ContinuousBatcher(model, EOS, max_batch=8)
    normal = {f"ok{i}": [10 + i, 20, 30 + i] for i in range(4)}
    for sid, prompt in normal.items():
        engine.add(sid, prompt, SamplingParams(max_tokens=12))
    engine.add("bad", [7] * 45, SamplingParams(max_tokens=5))  # positions 0..44: NaN at 40
    events, steps = [], 0
    while engine.has_work():
        events += engine.step()
        steps += 1
    [bad] = [e for e in events if e.seq_id == "bad"]
    assert bad.finish_reason == "error" and "non-finite logits" in bad.error
    for sid, prompt in normal.items():
        assert [e.token for e in events if e.seq_id == sid] == alone(model, prompt, 12), sid
    engine.add("bad2", [7] * 45, SamplingParams(max_tokens=5))
    with pytest.raises(RuntimeError, match="sequence bad2: FloatingPointError"):
        engine.run()  # the rollouts' batch form raises instead


def test_sampling_parameters_are_brought_into_safe_ranges():
    model = tiny()
    engine = ContinuousBatcher(model, EOS)
    engine.add("tiny-t", [5, 6], SamplingParams(max_tokens=8, temperature=1e-300))
    engine.add("big-seed", [5, 6], SamplingParams(max_tokens=8, temperature=0.8, seed=2 ** 64 + 3))
    engine.add("seed-3", [5, 6], SamplingParams(max_tokens=8, temperature=0.8, seed=3))
    got = run(engine)
    assert got["tiny-t"] == alone(model, [5, 6], 8)  # greedy
    assert got["big-seed"] == got["seed-3"]  # seeds are taken modulo 2**64
    for bad, field in ((dict(temperature=float("nan")), "temperature"),
                       (dict(top_p=0.0), "top_p"), (dict(max_tokens=0), "max_tokens")):
        with pytest.raises(ValueError, match=f"^{field}:"):
            engine.add("x", [1], SamplingParams(**bad))


def test_a_shared_prompt_is_prefilled_once_and_sampled_apart():
    """Samples of one prompt (GRPO's group, a request's n) share one prefill: the model runs
    the prompt once, and each sample gets the tokens it gets when it comes alone."""
    model = tiny()
    prompt = list(b"sort 4213:")
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=s) for s in range(4)]
    prefills = []
    hidden = model.hidden
    model.hidden = lambda idx, **kw: (prefills.append(idx.shape) if idx.shape[1] > 1 else None,
                                      hidden(idx, **kw))[1]
    engine = ContinuousBatcher(model, EOS, max_batch=8)
    for i, p in enumerate(params):
        engine.add(f"s{i}", prompt, p)
    engine.add("other", list(b"sort 99:"), params[0])
    together = run(engine)
    assert prefills == [(2, len(prompt))]  # two distinct prompts, one prefill row each
    for i, p in enumerate(params):
        one = ContinuousBatcher(model, EOS, max_batch=1)
        one.add("x", prompt, p)
        assert together[f"s{i}"] == run(one)["x"]
    assert len({tuple(together[f"s{i}"]) for i in range(4)}) > 1  # the seeds differ


@pytest.mark.parametrize("arch", [{}, dict(positions="rope", norm="rmsnorm", mlp="swiglu",
                                           n_kv_head=1)])
def test_an_opening_every_prompt_shares_runs_once(arch):
    """Prompts that open with the same 20 tokens (a system prompt) admitted together: the
    opening runs once, copied to every row (prefill_tokens counts it once), and each
    sequence's greedy tokens equal decoding it alone; first logits as the whole prompts'."""
    torch.manual_seed(3)
    model = GPT(GPTConfig(vocab_size=257, seq_len=64, n_layer=2, n_head=2, d_model=32, **arch),
                seed=3).eval()
    rng = random.Random(3)
    opening = [rng.randrange(256) for _ in range(20)]
    prompts = [opening + [rng.randrange(256) for _ in range(n)] for n in (1, 5, 3, 7)]
    engine = ContinuousBatcher(model, EOS, max_batch=4)
    for i, p in enumerate(prompts):
        engine.add(str(i), p, SamplingParams(max_tokens=8, logprobs=0))
    first = {ev.seq_id: ev for ev in engine.step() if ev.token is not None}
    assert engine.prefill_tokens == 20 + 1 + 5 + 3 + 7
    out = run(engine)
    for i, p in enumerate(prompts):
        want = alone(model, p, 8)
        assert [first[str(i)].token] + out.get(str(i), []) == want
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([p]))[0][0, -1], -1)[want[0]]
        assert abs(first[str(i)].logprob - float(logp)) < 1e-5
