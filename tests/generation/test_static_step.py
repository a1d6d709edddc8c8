"""The fixed-shape decode step (troupe.generation.static_step), on the CPU: the engine's tokens
with it are those without it (greedy and seeded draws, across joins and leaves); traced, the
step has no graph break (so no host read inside), compiles once per batch bucket whatever
joins and leaves, and its inputs keep their addresses from step to step."""

import random

import pytest
import torch

from troupe.generation import ContinuousBatcher, SamplingParams
from troupe.generation.static_step import bucket
from troupe.models import GPT, GPTConfig

LLAMA = dict(positions="rope", norm="rmsnorm", mlp="swiglu", out_bias=False, mlp_bias=False)


def _model(**kw):
    cfg = dict(vocab_size=97, seq_len=48, n_layer=2, n_head=4, d_model=64)
    return GPT(GPTConfig(**{**cfg, **kw}), seed=2).eval()


def _requests(n=9, seed=0):
    """Prompts of 1 to 12 tokens, 2 to 14 new tokens, every third greedy, arriving over time."""
    rng = random.Random(seed)
    return {f"r{i}": (rng.randrange(0, 10), [rng.randrange(97) for _ in range(rng.randrange(1, 13))],
                      SamplingParams(max_tokens=rng.randrange(2, 15),
                                     temperature=0.0 if i % 3 == 0 else 0.9,
                                     top_k=(0, 5)[i % 2], top_p=(1.0, 0.8)[i % 2], seed=i,
                                     logprobs=0))
            for i in range(n)}


def _drive(engine, requests):
    """Run ``requests`` (sid -> (step it arrives, prompt, params)) to the end; the tokens and
    log-probabilities of each, and the batch sizes of the steps."""
    out, logp, sizes, step = {}, {}, [], 0
    pending = dict(requests)
    while engine.has_work() or pending:
        for sid, (at, prompt, params) in list(pending.items()):
            if at <= step:
                engine.add(sid, prompt, params)
                del pending[sid]
        sizes.append(len(engine.active))
        for ev in engine.step():
            out.setdefault(ev.seq_id, []).append(ev.token)
            logp.setdefault(ev.seq_id, []).append(ev.logprob)
        step += 1
    return out, logp, sizes


@pytest.mark.parametrize("arch", [{}, dict(**LLAMA, n_kv_head=2)])
def test_the_static_step_gives_the_eager_engines_tokens(arch):
    model = _model(**arch)
    requests = _requests()
    want, want_logp, _ = _drive(ContinuousBatcher(model, None, max_batch=4), requests)
    engine = ContinuousBatcher(model, None, max_batch=4, static=True, static_len=26)
    got, got_logp, sizes = _drive(engine, requests)
    assert got == want
    for sid in want:
        assert got_logp[sid] == pytest.approx(want_logp[sid], abs=1e-4)
    assert {bucket(n, 4) for n in sizes if n} == {1, 2, 4}  # joins and leaves, every bucket
    assert engine.slots.columns == 26  # preallocated (a prompt and its tokens), never grown
    with pytest.raises(ValueError, match="static cache of 26 positions"):
        engine.add("long", [1] * 20, SamplingParams(max_tokens=7))


def test_the_traced_step_has_no_break_one_graph_a_bucket_and_fixed_inputs():
    model = _model(**LLAMA, n_kv_head=2)
    graphs = []

    def backend(gm, example_inputs):  # counts the graphs torch.compile makes, runs them as is
        graphs.append(gm)
        return gm.forward

    engine = ContinuousBatcher(model, None, max_batch=4, static=True, compile=backend)
    step = engine.static
    explained = torch._dynamo.explain(step._run)(2)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained
    addresses = {name: getattr(step, name).data_ptr() for name in
                 ("tokens", "counts", "temperature", "top_k", "top_p", "seeds", "positions")}
    cache = [t.data_ptr() for t in engine.slots.k + engine.slots.v]
    torch._dynamo.reset()
    got, _, sizes = _drive(engine, _requests(12, seed=1))
    used = {bucket(n, 4) for n in sizes if n}
    assert used == {1, 2, 4} and len(graphs) == len(used)
    assert addresses == {name: getattr(step, name).data_ptr() for name in addresses}
    assert cache == [t.data_ptr() for t in engine.slots.k + engine.slots.v]
    want, _, _ = _drive(ContinuousBatcher(model, None, max_batch=4), _requests(12, seed=1))
    assert got == want


def test_rows_the_device_draw_cannot_serve_run_eagerly():
    """A sequence with a logit bias (chosen on the host) beside plain ones: the step runs
    eagerly for the whole batch, with the same tokens."""
    model = _model()
    requests = _requests(4)
    at, prompt, params = requests["r1"]
    requests["r1"] = (at, prompt, SamplingParams(**{**params.__dict__, "logit_bias": {3: 5.0}}))
    want, _, _ = _drive(ContinuousBatcher(model, None, max_batch=4), requests)
    got, _, _ = _drive(ContinuousBatcher(model, None, max_batch=4, static=True), requests)
    assert got == want


@pytest.mark.gpu
def test_cuda_graphs_of_the_step_give_the_cpu_engines_tokens():
    """On a GPU: the step captured per bucket (torch.compile's "reduce-overhead", CUDA
    graphs) decodes greedy and seeded rows as the CPU's eager engine does (fp32; a token may
    differ only where two logits tie within float rounding, so compare the greedy ones)."""
    model = _model(**LLAMA, n_kv_head=2)
    requests = {sid: r for sid, r in _requests(12, seed=3).items() if r[2].temperature == 0}
    want, _, _ = _drive(ContinuousBatcher(model, None, max_batch=4), requests)
    engine = ContinuousBatcher(model.cuda(), None, max_batch=4, static=True,
                               compile="reduce-overhead")
    got, _, _ = _drive(engine, requests)
    assert got == want


def test_weights_updated_in_place_are_read_by_the_traced_step_without_a_new_graph():
    """An RL update writes the parameters in place (an optimizer step, a weight sync's copy):
    the traced step reads them as they are, with no new graph, and decodes what an engine
    built afresh on the new weights decodes."""
    model = _model(**LLAMA, n_kv_head=2)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    engine = ContinuousBatcher(model, None, max_batch=2, static=True, compile=backend,
                               static_len=40)
    requests = {"a": (0, [3, 4, 5, 6], SamplingParams(max_tokens=8)),
                "b": (0, [7, 8, 9], SamplingParams(max_tokens=8))}
    before, _, _ = _drive(engine, requests)
    made = len(graphs)
    with torch.no_grad():  # "the update": new values in the same storage
        for p in model.parameters():
            p.mul_(-1.5).add_(0.01)
    after, _, _ = _drive(engine, requests)
    assert len(graphs) == made and after != before
    fresh, _, _ = _drive(ContinuousBatcher(model, None, max_batch=2), requests)
    assert after == fresh
