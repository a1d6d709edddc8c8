"""Prefix caching in the engine (troupe.generation.prefix_cache): the same tokens as without it,
greedy and sampled, with only what follows a cached prefix run; a GRPO group admitted one at a
time prefills its prompt once; other weights (a namespace) never reuse keys; the budget holds."""

import torch

from troupe.generation import ContinuousBatcher, SamplingParams
from troupe.generation.prefix_cache import PrefixCache
from troupe.models import GPT, GPTConfig

EOS = 256


def tiny(positions="rope"):
    cfg = GPTConfig(vocab_size=257, seq_len=384, n_layer=2, n_head=4, n_kv_head=2, d_model=32,
                    positions=positions)
    return GPT(cfg, seed=0).eval()


def drive(engine, arrivals):
    """``arrivals``: (step, seq_id, prompt, params); returns seq_id -> tokens."""
    out, step, pending = {}, 0, list(arrivals)
    while engine.has_work() or pending:
        for a in [a for a in pending if a[0] <= step]:
            engine.add(*a[1:])
            pending.remove(a)
        for ev in engine.step():
            assert ev.error is None, ev.error
            out.setdefault(ev.seq_id, []).append(ev.token)
        step += 1
    return out


def test_same_tokens_with_less_prefill():
    g = torch.Generator().manual_seed(0)
    system = torch.randint(0, 256, (40,), generator=g).tolist()
    arrivals = []
    for i in range(6):  # one newcomer every few steps, each after the shared 40 tokens
        tail = torch.randint(0, 256, (5 + i,), generator=g).tolist()
        params = SamplingParams(max_tokens=12, temperature=0.0 if i % 2 else 1.0, seed=i)
        arrivals.append((3 * i, f"r{i}", system + tail, params))
    for positions in ("rope", "learned"):
        model = tiny(positions)
        plain = ContinuousBatcher(model, EOS, max_batch=4, packed_decode=False)
        cached = ContinuousBatcher(model, EOS, max_batch=4, packed_decode=False,
                                   prefix_cache=PrefixCache(block=16))
        assert drive(cached, arrivals) == drive(plain, arrivals)
        total = sum(len(a[2]) for a in arrivals)
        assert plain.prefill_tokens == total
        assert cached.prefill_tokens == total - 5 * 32  # two whole blocks of the 40 reused
        assert cached.prefix_cache.hit_tokens == 5 * 32


def test_a_group_admitted_one_by_one_prefills_its_prompt_once():
    """GRPO's 4 samples of a 256-token prompt in a batch of one: the first runs the prompt,
    the others only its last block (whose last token gives their first logits)."""
    model = tiny()
    prompt = torch.randint(0, 256, (256,), generator=torch.Generator().manual_seed(1)).tolist()
    arrivals = [(0, f"s{i}", prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=i))
                for i in range(4)]
    plain = ContinuousBatcher(model, EOS, max_batch=1, packed_decode=False)
    cached = ContinuousBatcher(model, EOS, max_batch=1, packed_decode=False,
                               prefix_cache=PrefixCache())
    assert drive(cached, arrivals) == drive(plain, arrivals)
    assert plain.prefill_tokens == 4 * 256
    assert cached.prefill_tokens == 256 + 3 * 16


def test_other_weights_never_reuse_and_the_budget_holds():
    model = tiny()
    prompt = list(range(100))
    cache = PrefixCache(block=16)
    engine = ContinuousBatcher(model, EOS, packed_decode=False, prefix_cache=cache)
    drive(engine, [(0, "a", prompt, SamplingParams(max_tokens=2))])
    engine.cache_namespace = "version 2"
    drive(engine, [(0, "b", prompt, SamplingParams(max_tokens=2))])
    assert cache.hit_tokens == 0 and engine.prefill_tokens == 200
    drive(engine, [(0, "c", prompt, SamplingParams(max_tokens=2))])
    assert cache.hit_tokens == 96
    block_bytes = max(b.nbytes for b in cache.blocks.values())  # a whole block (not a tail)
    small = PrefixCache(budget_bytes=3 * block_bytes, block=16)
    engine = ContinuousBatcher(model, EOS, packed_decode=False, prefix_cache=small)
    drive(engine, [(0, "a", prompt, SamplingParams(max_tokens=2))])
    assert len(small.blocks) == 3 and small.nbytes <= small.budget_bytes
    # under pressure the deepest blocks went: the three kept are the prompt's first 48 tokens
    drive(engine, [(0, "b", prompt, SamplingParams(max_tokens=2))])
    assert small.hit_tokens == 48 and engine.prefill_tokens == 100 + 52
