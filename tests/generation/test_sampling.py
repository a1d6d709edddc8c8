"""logit_bias, the repetition, frequency and presence penalties and top-k: each against a
reference (transformers' logits processors, or the formula applied to a plain forward)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from troupe.generation import ContinuousBatcher, SamplingParams  # noqa: E402
from troupe.models import from_pretrained  # noqa: E402

VOCAB = 97


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny random Llama, as transformers has it and as troupe loads it."""
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(cfg).eval()
    reference.generation_config.eos_token_id = None  # every sequence runs to max_tokens
    path = tmp_path_factory.mktemp("llama") / "hf"
    reference.save_pretrained(path)
    return reference, from_pretrained(path)


PROMPT = [5, 17, 5, 40, 17, 9, 88, 5]
# PROMPT and the first tokens the model continues it with (greedy), which it would choose
# again: a penalty on the prompt's tokens changes the choice
REPEATS = PROMPT + [16, 70, 50, 80, 62, 80]


def engine_tokens(model, params, prompts=(PROMPT,), logprobs=False):
    engine = ContinuousBatcher(model, None, max_batch=4)
    for i, prompt in enumerate(prompts):
        engine.add(str(i), list(prompt), params)
    events = engine.run_events()
    tokens = [[ev.token for ev in events if ev.seq_id == str(i)] for i in range(len(prompts))]
    return (tokens, events) if logprobs else tokens


@torch.no_grad()
def reference_tokens(reference, n, adjust, prompt=PROMPT):
    """Greedy decoding by recomputing the whole sequence, ``adjust(logits, output)`` applied
    to each step's logits."""
    ids, out = list(prompt), []
    for _ in range(n):
        logits = reference(torch.tensor([ids])).logits[0, -1].float()
        token = int(adjust(logits.clone(), out).argmax())
        out.append(token)
        ids.append(token)
    return out


def test_repetition_penalty_chooses_what_transformers_chooses(llama):
    """Over the prompt's tokens and the output's, as transformers' and vLLM's penalty."""
    reference, ours = llama
    assert engine_tokens(ours, SamplingParams(max_tokens=6))[0] == REPEATS[len(PROMPT):]
    for penalty in (1.3, 0.7):
        with torch.no_grad():
            want = reference.generate(torch.tensor([REPEATS]), max_new_tokens=24,
                                      do_sample=False, repetition_penalty=penalty, pad_token_id=0,
                                      attention_mask=torch.ones(1, len(REPEATS), dtype=torch.long))
        got = engine_tokens(ours, SamplingParams(max_tokens=24, repetition_penalty=penalty),
                            prompts=[REPEATS])
        assert got == [want[0, len(REPEATS):].tolist()]
        assert got != engine_tokens(ours, SamplingParams(max_tokens=24), prompts=[REPEATS])


def test_frequency_and_presence_penalties_and_logit_bias_follow_the_formula(llama):
    reference, ours = llama
    bias = {3: 2.5, 40: -1.5, 61: 1.0}

    def adjusted(frequency, presence):
        def adjust(logits, out):
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=VOCAB)
            logits -= frequency * counts.float() + presence * (counts > 0).float()
            for token, b in bias.items():
                logits[token] += b
            return logits
        return adjust

    plain = reference_tokens(reference, 24, lambda logits, out: logits)
    # a negative frequency penalty brings repeats, whose count then tells it from presence
    for frequency, presence in ((0.9, 0.6), (-0.4, 1.5)):
        params = SamplingParams(max_tokens=24, frequency_penalty=frequency,
                                presence_penalty=presence, logit_bias=bias)
        want = reference_tokens(reference, 24, adjusted(frequency, presence))
        assert engine_tokens(ours, params) == [want]
        assert want != plain
    assert want != reference_tokens(reference, 24, adjusted(frequency + presence, 0))


def test_a_full_bias_forces_or_bans_a_token_and_sampled_logprobs_say_so(llama):
    _, ours = llama
    (forced,), events = engine_tokens(
        ours, SamplingParams(max_tokens=6, temperature=1.0, seed=1, logit_bias={42: 100},
                             logprobs=0), logprobs=True)
    assert forced == [42] * 6
    for ev in events:  # the model's own distribution, and the biased one it was drawn from
        assert ev.logprob < -1 and ev.sampled_logprob == pytest.approx(0, abs=1e-6)
    plain = engine_tokens(ours, SamplingParams(max_tokens=6))[0]
    banned = engine_tokens(ours, SamplingParams(max_tokens=6, logit_bias={plain[0]: -100}))[0]
    assert banned[0] != plain[0]
    unbiased = engine_tokens(ours, SamplingParams(max_tokens=6, logprobs=0), logprobs=True)[1]
    assert all(ev.sampled_logprob is None for ev in unbiased)


def test_top_k_draws_only_among_the_k_likeliest(llama):
    reference, ours = llama
    with torch.no_grad():
        logits = reference(torch.tensor([PROMPT])).logits[0, -1]
    top3 = set(logits.topk(3).indices.tolist())
    firsts = {engine_tokens(ours, SamplingParams(max_tokens=1, temperature=2.0, top_k=3,
                                                 seed=seed))[0][0] for seed in range(40)}
    assert firsts <= top3 and len(firsts) > 1
    wide = {engine_tokens(ours, SamplingParams(max_tokens=1, temperature=2.0, seed=seed))[0][0]
            for seed in range(40)}
    assert not wide <= top3  # without top-k, a temperature of 2 strays beyond them


def test_rows_with_and_without_adjustments_batch_together(llama):
    """Each row's adjustments are its own: batched, every sequence gets its tokens alone."""
    _, ours = llama
    settings = [SamplingParams(max_tokens=10), SamplingParams(max_tokens=10, logit_bias={7: 5}),
                SamplingParams(max_tokens=10, repetition_penalty=1.5),
                SamplingParams(max_tokens=10, frequency_penalty=-2.0)]
    alone = [engine_tokens(ours, p)[0] for p in settings]
    engine = ContinuousBatcher(ours, None, max_batch=4)
    for i, p in enumerate(settings):
        engine.add(str(i), PROMPT, p)
    got = engine.run()
    assert [got[str(i)] for i in range(4)] == alone
    assert len({tuple(t) for t in alone}) == 4


@pytest.mark.parametrize("bad, match", [
    (dict(logit_bias={VOCAB: 1.0}), "logit_bias: token 97 is not in the model's vocabulary"),
    (dict(logit_bias={3: 101}), "logit_bias: the bias of token 3"),
    (dict(logit_bias={3: float("nan")}), "logit_bias: the bias of token 3"),
    (dict(logit_bias={-1: 1}), "logit_bias: token ids"),
    (dict(repetition_penalty=0.0), "repetition_penalty:"),
    (dict(frequency_penalty=2.5), "frequency_penalty:"),
    (dict(presence_penalty=float("inf")), "presence_penalty:"),
    (dict(top_k=-1), "top_k:"),
])
def test_bad_settings_are_refused_naming_the_field(llama, bad, match):
    engine = ContinuousBatcher(llama[1], None)
    with pytest.raises(ValueError, match=match):
        engine.add("x", PROMPT, SamplingParams(max_tokens=2, **bad))
    assert not engine.has_work()


def test_top_p_applies_to_what_top_k_kept():
    """As transformers' and vLLM's samplers: top-k, renormalised, then top-p."""
    from troupe.generation.sampling import draw, uniform
    logits = torch.tensor([0.40, 0.35, 0.25]).log()
    # top-2 leaves 0.53 and 0.47, of which top-p 0.5 keeps the first alone (without the
    # renormalisation, 0.40 < 0.5 would keep the second too)
    p = SamplingParams(temperature=1.0, top_k=2, top_p=0.5)
    assert {draw(logits, p, uniform(0, i)) for i in range(50)} == {0}
    p = SamplingParams(temperature=1.0, top_k=2)
    assert {draw(logits, p, uniform(0, i)) for i in range(50)} == {0, 1}


def test_stop_token_ids_min_tokens_and_ignore_eos(llama):
    reference, ours = llama
    plain = reference_tokens(reference, 12, lambda logits, out: logits)
    eos, stop = plain[3], plain[2]

    def ended(eos_id, **params):
        engine = ContinuousBatcher(ours, eos_id, max_batch=2)
        engine.add("x", PROMPT, SamplingParams(max_tokens=12, **params))
        events = engine.run_events()
        return [ev.token for ev in events], events[-1].finish_reason

    assert ended(eos) == (plain[:4], "stop")
    assert ended(eos, ignore_eos=True) == (plain, "length")
    assert ended(None, stop_token_ids=(stop,)) == (plain[:3], "stop")

    def banned_before(k):
        def adjust(logits, out):
            if len(out) < k:
                logits[[eos, stop]] = float("-inf")
            return logits
        return adjust

    want = reference_tokens(reference, 12, banned_before(6))
    end = next((i for i, t in enumerate(want) if i >= 6 and t in (eos, stop)), None)
    tokens, finish = ended(eos, min_tokens=6, stop_token_ids=(stop,))
    assert eos not in tokens[:6] and stop not in tokens[:6]
    assert (tokens, finish) == ((want, "length") if end is None else (want[:end + 1], "stop"))


def test_stop_strings_include_and_min_tokens():
    """A byte-level model, whose text is its tokens: a stop string ends the text before it
    (or after it, with include_stop_str_in_output); before min_tokens it does not count."""
    from tests.generation.test_engine import EOS, tiny
    model = tiny()
    letters = {ord(c): 20.0 for c in "abcdefghijklmnopqrstuvwxyz"}  # a text of letters

    def text(**params):
        engine = ContinuousBatcher(model, EOS)
        engine.add("x", [5, 6, 7], SamplingParams(max_tokens=24, temperature=1.0, seed=3,
                                                  logit_bias=letters, **params))
        events = engine.run_events()
        return "".join(ev.delta for ev in events), events[-1].finish_reason

    whole, finish = text()
    assert finish == "length" and len(whole) == 24 and whole.isalpha()
    at = next(i for i in range(4, 12) if whole.count(whole[i:i + 2]) == 1)
    stop = whole[at:at + 2]
    assert text(stop=(stop,)) == (whole[:at], "stop")
    assert text(stop=(stop,), include_stop_str_in_output=True) == (whole[:at + 2], "stop")
    assert text(stop=(stop,), min_tokens=at + 3) == (whole, "length")


def test_draws_follow_the_distribution_and_stay_in_the_nucleus():
    """The draw (one uniform number through the cumulative sum) picks each token as often as
    its probability says, never one the mask excluded, and under top-p only from the nucleus
    a full sort gives, whichever of its paths (top 64, top 1024, all sorted) found it."""
    from troupe.generation.sampling import draw, uniform
    logits = torch.tensor([2.0, 1.0, 0.5, float("-inf"), 0.0, -1.0, float("-inf")])
    probs = torch.softmax(logits, -1)
    n = 20000
    counts = torch.bincount(torch.tensor([draw(logits, SamplingParams(temperature=1.0),
                                               uniform(0, i)) for i in range(n)]),
                            minlength=7).double()
    assert counts[3] == counts[6] == 0
    sigma = (probs * (1 - probs) / n).sqrt()
    assert ((counts / n - probs).abs() <= 5 * sigma + 1e-9).all(), (counts / n, probs)
    for scale in (12.0, 4.0, 0.3):  # the nucleus within 64 tokens, within 1024, beyond
        logits = torch.randn(5000, generator=torch.Generator().manual_seed(1)) * scale
        ordered, order = torch.softmax(logits, -1).sort(descending=True)
        for top_p in (0.5, 0.9):
            nucleus = set(order[:int((ordered.cumsum(0) - ordered < top_p).sum())].tolist())
            p = SamplingParams(temperature=1.0, top_p=top_p)
            drawn = {draw(logits, p, uniform(1, i)) for i in range(300)}
            assert drawn <= nucleus and len(drawn) > min(len(nucleus), 10) // 2


def test_stop_tokens_alone_leave_the_distribution_the_models(llama):
    """Stop tokens end a sequence without changing what it samples from: no adjusted
    log-probability is reported for them, and a stop id outside the vocabulary is named."""
    _, ours = llama
    (tokens,), events = engine_tokens(ours, SamplingParams(max_tokens=8, logprobs=0,
                                                           stop_token_ids=(VOCAB - 1,)),
                                      logprobs=True)
    assert all(ev.sampled_logprob is None for ev in events)
    with pytest.raises(ValueError, match="stop_token_ids: token 97 is not in the model's"):
        ContinuousBatcher(ours, None).add("x", PROMPT, SamplingParams(stop_token_ids=(VOCAB,)))


def test_draws_are_counter_based_the_same_on_any_device_and_uniform():
    """A draw's uniform number is a function of (seed, position) alone: the host's and the
    tensor form (what a device step computes) agree bit for bit, over the whole 64-bit seed
    range; the numbers are uniform (a Kolmogorov-Smirnov bound over 20,000) and neighbouring
    seeds and positions are not correlated."""
    from troupe.generation.sampling import SEED_RANGE, uniform, uniforms
    seeds = [0, 1, 2, 7, 2 ** 31, 2 ** 63 - 1, 2 ** 63, SEED_RANGE - 1]
    positions = [0, 1, 2, 100, 4095]
    host = torch.tensor([[uniform(s, i) for i in positions] for s in seeds], dtype=torch.float64)
    signed = torch.tensor([s - SEED_RANGE if s >= 2 ** 63 else s for s in seeds])
    device = uniforms(signed[:, None], torch.tensor(positions)[None])
    assert torch.equal(host, device)
    u = uniforms(torch.arange(200)[:, None], torch.arange(100)[None]).flatten()
    assert ((u >= 0) & (u < 1)).all()
    ks = (u.sort().values - torch.arange(1, 20001, dtype=torch.float64) / 20000).abs().max()
    assert ks < 1.63 / 20000 ** 0.5  # the 1% critical value
    grid = u.view(200, 100)
    for a, b in ((grid[:-1], grid[1:]), (grid[:, :-1], grid[:, 1:])):  # next seed, position
        assert abs(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]) < 0.03


def test_the_device_draw_gives_the_host_draws_tokens():
    """``draw_rows`` (the whole batch's draws as tensor ops, what a captured step runs) picks
    the token ``draw`` picks for each row's parameters, seed and position: greedy rows, top-k,
    top-p and both, over peaked and flat distributions."""
    from troupe.generation.sampling import draw, draw_rows, uniform
    g = torch.Generator().manual_seed(0)
    rows = [(t, k, p) for t in (0.0, 0.7, 1.0, 1.5) for k in (0, 1, 5, 50)
            for p in (1.0, 0.9, 0.3)]
    B, V = len(rows), 300
    logits = torch.randn(B, V, generator=g) * torch.tensor([0.5, 3.0])[torch.arange(B) % 2, None]
    for position in range(6):
        seeds = torch.arange(B) * 7919 + 11
        got = draw_rows(logits, torch.tensor([r[0] for r in rows]),
                        torch.tensor([r[1] for r in rows]), torch.tensor([r[2] for r in rows]),
                        seeds, torch.full((B,), position))
        want = [int(logits[i].argmax()) if t <= 0 else
                draw(logits[i], SamplingParams(temperature=t, top_k=k, top_p=p),
                     uniform(int(seeds[i]), position))
                for i, (t, k, p) in enumerate(rows)]
        assert got.tolist() == want, position
