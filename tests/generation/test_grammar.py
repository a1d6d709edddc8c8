"""Constrained decoding in the engine (troupe.generation.grammar): whatever the model's weights,
sampled outputs follow the schema, regex or grammar; the masked and the model's own
log-probabilities are both reported; what cannot compile is refused naming the construct."""

import json
import re

import jsonschema
import pytest

from troupe.generation import ContinuousBatcher, SamplingParams
from troupe.generation.grammar import Constraint, GrammarError, Grammars
from troupe.models import GPT, GPTConfig

pytestmark = pytest.mark.slow  # the SmolLM2 tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "color": {"enum": ["red", "green", "blue"]},
        "sizes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                  "maxItems": 3},
        "owner": {"type": "object",
                  "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9},
                                 "ok": {"type": "boolean"}},
                  "required": ["id"], "additionalProperties": False},
    },
    "required": ["name", "color", "owner"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def setup(smollm2):
    from troupe.data import load_tokenizer

    tok = load_tokenizer(smollm2)
    model = GPT(GPTConfig(vocab_size=49152, seq_len=256, n_layer=2, n_head=2, d_model=32),
                seed=0).eval()  # random weights: the grammar alone keeps the output in shape
    return tok, model, Grammars(tok.hf, 49152, tok.eos_id)


def _generate(setup, constraint, n=8, temperature=1.0, logprobs=None, max_tokens=120):
    tok, model, grammars = setup
    engine = ContinuousBatcher(model, tok.eos_id, max_batch=8, tokenizer=tok.hf,
                               grammars=grammars)
    prompt = tok.encode("Describe a thing as JSON:")
    for i in range(n):
        engine.add(str(i), prompt, SamplingParams(max_tokens=max_tokens,
                                                  temperature=temperature, seed=i,
                                                  logprobs=logprobs, constraint=constraint))
    texts, events = {}, []
    while engine.has_work():
        for ev in engine.step():
            assert ev.error is None, ev.error
            texts[ev.seq_id] = texts.get(ev.seq_id, "") + ev.delta
            events.append(ev)
    finishes = {ev.seq_id: ev.finish_reason for ev in events if ev.finish_reason}
    return texts, finishes, events


def test_sampled_outputs_follow_a_nested_schema(setup):
    texts, finishes, _ = _generate(setup, Constraint("json_schema", json.dumps(SCHEMA)), n=16)
    assert set(finishes.values()) == {"stop"}  # a bounded schema ends before max_tokens
    for text in texts.values():
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_regex_and_lark(setup):
    texts, finishes, _ = _generate(setup, Constraint("json_object"), n=8, max_tokens=60)
    for i, t in texts.items():  # random weights may not close an unbounded object in time
        assert t.startswith("{"), t
        if finishes[i] == "stop":
            assert isinstance(json.loads(t), dict), t
    texts, _, _ = _generate(setup, Constraint("regex", r"(yes|no), [0-9]{2,4}!"), n=6)
    assert all(re.fullmatch(r"(yes|no), [0-9]{2,4}!", t) for t in texts.values()), texts
    lark = 'start: "sum(" num ("+" num)* ")"\nnum: /[1-9][0-9]?/'
    texts, _, _ = _generate(setup, Constraint("grammar", lark), n=6, max_tokens=40)
    for t in texts.values():
        assert re.fullmatch(r"sum\([1-9][0-9]?(\+[1-9][0-9]?)*\)", t), t


def test_masked_and_model_log_probabilities(setup):
    """Each token's log-probability under the masked distribution it was sampled from is at
    least the model's own (the mask renormalises over fewer tokens); greedy decoding picks the
    masked argmax; run_with_logprobs hands the masked one to the rollouts."""
    c = Constraint("regex", r"[a-z]{3,6}")
    _, _, events = _generate(setup, c, n=4, logprobs=0)
    tokens = [ev for ev in events if ev.token is not None]
    assert tokens and all(ev.sampled_logprob is not None for ev in tokens)
    assert all(ev.sampled_logprob >= ev.logprob - 1e-5 and ev.sampled_logprob <= 0
               for ev in tokens)
    assert any(ev.sampled_logprob > ev.logprob + 1e-3 for ev in tokens)
    tok, model, grammars = setup
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=3, logprobs=0, constraint=c)
    engine = ContinuousBatcher(model, tok.eos_id, max_batch=4, grammars=grammars)
    engine.add("a", tok.encode("x"), params)
    _, logp = engine.run_with_logprobs()
    engine.add("a", tok.encode("x"), params)  # the same sequence again, event by event
    masked = [ev.sampled_logprob for ev in engine.run_events()]
    assert logp["a"] == masked


def test_what_cannot_compile_is_named(setup):
    _, _, grammars = setup
    with pytest.raises(GrammarError, match="look-around"):
        grammars.check(Constraint("json_schema", json.dumps(
            {"type": "string", "pattern": "(?<=a)b"})))
    with pytest.raises(GrammarError, match="strnig"):
        grammars.check(Constraint("json_schema", '{"type": "strnig"}'))
    with pytest.raises(GrammarError, match="unclosed group"):
        grammars.check(Constraint("regex", "a(b"))
    tok, model, _ = setup
    plain = ContinuousBatcher(model, tok.eos_id)  # no grammar support: refused by name
    with pytest.raises(ValueError, match="constraint"):
        plain.add("x", [1, 2], SamplingParams(constraint=Constraint("json_object")))


def test_compiled_once_per_constraint(setup):
    _, _, grammars = setup
    c = Constraint("json_schema", json.dumps(SCHEMA))
    first = grammars.check(c)
    assert grammars.check(Constraint("json_schema", json.dumps(SCHEMA))) is first


def test_constrained_rows_speculate_to_the_same_outputs(setup):
    """Speculative decoding under a grammar (prompt lookup; each position chosen under the
    mask as it stands after the tokens accepted before it): the same sampled outputs as
    without speculation, each valid JSON of the schema."""
    tok, model, grammars = setup
    constraint = Constraint("json_schema", json.dumps(SCHEMA))
    outs = []
    for k in (0, 4):
        engine = ContinuousBatcher(model, tok.eos_id, max_batch=4, tokenizer=tok.hf,
                                   grammars=grammars, speculate=k)
        prompt = tok.encode('Describe a thing as JSON: {"name": "a", "color": "red"}')
        for i in range(4):
            engine.add(str(i), prompt, SamplingParams(max_tokens=120, temperature=1.0, seed=i,
                                                      constraint=constraint))
        outs.append(engine.run())
    assert outs[0] == outs[1] and engine.speculation["passes"] > 0
    for ids in outs[1].values():
        jsonschema.validate(json.loads(tok.decode(ids)), SCHEMA)
