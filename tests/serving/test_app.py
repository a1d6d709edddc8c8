"""The OpenAI-compatible app on Ray Serve, driven by the official `openai` client."""

import concurrent.futures as cf
import json
import os
import threading
import urllib.error
import urllib.request

import openai
import pytest

from troupe.generation import ContinuousBatcher, SamplingParams
from troupe.models import GPT, GPTConfig
from troupe.serving import deploy as serve
from troupe.serving.config import ServeConfig
from troupe.serving.model import load_served_model, save_model

pytestmark = pytest.mark.waits  # a server answering a few clients

KEY_ENV, KEY = "TROUPE_TEST_API_KEY", "sk-test-4f9a"
NAME = "tiny-w8a8"


@pytest.fixture(scope="module")
def app(cluster, serve_port, tmp_path_factory):
    path = tmp_path_factory.mktemp("serve") / "tiny.trp"
    save_model(GPT(GPTConfig(seq_len=96, n_layer=2, n_head=2, d_model=64), seed=3), path)
    cfg = ServeConfig(model={"file": str(path), "name": NAME}, quantize={"*": "w8a8"},
                      group_size=16, port=serve_port, api_key_env=KEY_ENV, device="cpu",
                      limits={"max_tokens": 40, "max_prompt_tokens": 48, "max_body_bytes": 4096,
                              "max_concurrent": 16, "max_batch": 8})
    os.environ[KEY_ENV] = KEY
    try:
        url = serve.deploy(cfg)
    finally:
        assert KEY_ENV not in os.environ  # deploy took the key out of the environment
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    model, _ = load_served_model(cfg)
    yield {"url": url, "client": client, "model": model}
    serve.shutdown()


def alone(model, prompt: str, n: int, **sampling) -> str:
    """The greedy text one sequence gets when decoded by itself."""
    engine = ContinuousBatcher(model, 256, max_batch=1)
    engine.add("x", list(prompt.encode()), SamplingParams(max_tokens=n, **sampling))
    text = ""
    while engine.has_work():
        text += "".join(e.delta for e in engine.step())
    return text


def post(url, body: bytes, key=KEY, path="/v1/completions"):
    req = urllib.request.Request(url + path, data=body, method="POST",
                                 headers={"Authorization": f"Bearer {key}",
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_openai_client_gets_a_completion(app):
    out = app["client"].completions.create(model=NAME, prompt="Hello, troupe",
                                           max_tokens=12, temperature=0)
    assert out.choices[0].text == alone(app["model"], "Hello, troupe", 12)
    assert out.choices[0].finish_reason in ("length", "stop")
    assert out.usage.prompt_tokens == len(b"Hello, troupe") and out.usage.completion_tokens >= 1
    assert [m.id for m in app["client"].models.list().data] == [NAME]


def test_chat_streaming_matches_the_whole_reply(app):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    whole = app["client"].chat.completions.create(model=NAME, messages=messages,
                                                  max_tokens=15, temperature=0)
    reply = whole.choices[0].message
    assert reply.role == "assistant"
    assert reply.content == alone(app["model"], "system: Be brief.\nuser: Hi\nassistant:", 15)
    parts = list(app["client"].chat.completions.create(model=NAME, messages=messages,
                                                       max_tokens=15, temperature=0,
                                                       stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == reply.content
    assert parts[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    streamed = app["client"].completions.create(model=NAME, prompt="abc", max_tokens=9,
                                                temperature=0, stream=True)
    assert "".join(p.choices[0].text for p in streamed) == alone(app["model"], "abc", 9)


def test_eight_concurrent_greedy_requests_equal_one_by_one(app):
    prompts = [f"request {i}: " + "xyz"[: i % 3] * (i + 1) for i in range(8)]
    lengths = [8 + 3 * i for i in range(8)]

    def ask(i):
        out = app["client"].completions.create(model=NAME, prompt=prompts[i],
                                               max_tokens=lengths[i], temperature=0)
        return out.choices[0].text

    one_by_one = [ask(i) for i in range(8)]
    with cf.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, range(8)))
    assert together == one_by_one
    assert one_by_one[3] == alone(app["model"], prompts[3], lengths[3])


@pytest.mark.parametrize("body, status, words", [
    (b'{"model": "tiny-w8a8", "prompt": "hi", ', 400, "not valid JSON"),
    (b'[1, 2]', 400, "the request body: Input should be an object"),
    (b'{"prompt": "hi"}', 400, "model: Field required"),
    (json.dumps({"model": NAME, "prompt": "x" * 5000}).encode(), 413, "exceeds the limit"),
    (json.dumps({"model": NAME, "prompt": "x" * 60}).encode(), 400, "at most 48"),
    (json.dumps({"model": NAME, "prompt": "hi", "max_tokens": 500}).encode(), 400, "max_tokens"),
    (json.dumps({"model": NAME, "prompt": "hi", "temperature": -1}).encode(), 400, "temperature"),
    (json.dumps({"model": NAME, "prompt": "hi", "n": 17}).encode(), 400, "n"),
    (json.dumps({"model": "gpt-5", "prompt": "hi"}).encode(), 404, "not served here"),
    (json.dumps({"model": NAME, "prompt": "hi", "logit_bias": {"257": 5}}).encode(), 400,
     "logit_bias: token 257 is not in the model's vocabulary"),
    (json.dumps({"model": NAME, "prompt": "hi", "logit_bias": {"7": 101}}).encode(), 400,
     "logit_bias.7"),
    (json.dumps({"model": NAME, "prompt": "hi", "presence_penalty": 2.5}).encode(), 400,
     "presence_penalty"),
    (json.dumps({"model": NAME, "prompt": "hi", "echo": True}).encode(), 400, "echo: not"),
    (json.dumps({"model": NAME, "prompt": "hi", "stop_token_ids": [257]}).encode(), 400,
     "stop_token_ids: token 257 is not in the model's vocabulary"),
    (json.dumps({"model": NAME, "prompt": "hi", "max_tokens": 4, "min_tokens": 5}).encode(),
     400, "min_tokens=5 exceeds max_tokens=4"),
    (json.dumps({"model": NAME, "prompt": [104, 300]}).encode(), 400,
     "prompt.1: token 300 is not in this model's vocabulary"),
    (json.dumps({"model": NAME, "prompt": [104, -1]}).encode(), 400, "token ids are whole"),
    (json.dumps({"model": NAME, "prompt": ["a"] * 9, "n": 2}).encode(), 400,
     "9 prompts x n=2 make 18 choices"),
    (json.dumps({"model": NAME, "prompt": ["ok", "x" * 60]}).encode(), 400, "prompt.1: "),
    (json.dumps({"model": NAME, "prompt": [[104], [105, -2]]}).encode(), 400,
     "prompt.1: token ids are whole"),
    (json.dumps({"model": NAME, "prompt": []}).encode(), 400, "the prompt is empty"),
    (json.dumps({"model": NAME, "prompt": [1] * 49}).encode(), 400, "at most 48"),
    (json.dumps({"model": NAME, "prompt": "hi", "best_of": 3}).encode(), 400, "best_of: not"),
])
def test_bad_requests_get_4xx_and_the_server_keeps_serving(app, body, status, words):
    code, out = post(app["url"], body)
    assert code == status and words in out["error"]["message"], out
    code, out = post(app["url"], json.dumps({"model": NAME, "prompt": "ok", "max_tokens": 3,
                                             "temperature": 0}).encode())
    assert code == 200 and out["choices"][0]["finish_reason"] in ("length", "stop")


def test_bearer_token_is_required(app):
    code, out = post(app["url"], json.dumps({"model": NAME, "prompt": "hi"}).encode(),
                     key="wrong")
    assert code == 401 and out["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=app["url"] + "/v1", api_key="nope", max_retries=0).models.list()


def test_the_api_key_is_in_no_file_of_the_ray_session(app):
    """The replicas get a salted digest of the key, never the key: Ray's logs, its runtime_env
    agent's included, cannot leak it (issue 14)."""
    import ray
    from pathlib import Path

    session = Path(ray._private.worker._global_node.get_session_dir_path())
    files = [p for p in session.rglob("*") if p.is_file() and not p.is_symlink()]
    assert files
    leaks = []
    for p in files:
        try:
            if KEY.encode() in p.read_bytes():
                leaks.append(str(p))
        except OSError:
            continue
    assert not leaks, leaks


def test_logprobs_are_the_models_log_softmax(app):
    """Completions' logprobs (and chat's) are the served model's own log-softmax of each
    chosen token (1e-4), with the likeliest tokens beside it."""
    import torch
    prompt = "Hello, troupe"
    out = app["client"].completions.create(model=NAME, prompt=prompt, max_tokens=8,
                                           temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    text = out.choices[0].text
    assert "".join(lp.tokens) == text and len(lp.token_logprobs) == len(lp.tokens)
    # (the API keys top_logprobs by token text: bytes that decode alike collapse into one key)
    assert lp.text_offset[0] == 0 and all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    ids = list(prompt.encode()) + list(text.encode())
    with torch.no_grad():
        logits = app["model"](torch.tensor([ids]))[0][0]
    want = torch.log_softmax(logits.float(), -1)
    P = len(prompt.encode())
    for i, (token, got) in enumerate(zip(text.encode(), lp.token_logprobs)):
        assert abs(want[P - 1 + i, token].item() - got) < 1e-4
        assert max(lp.top_logprobs[i].values()) == pytest.approx(got, abs=1e-6)  # greedy
    chat = app["client"].chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0,
        logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)


def test_a_prompt_of_token_ids_runs_as_given(app):
    """OpenAI's prompt as token ids (or a list of one such list): the same answer as the text
    those ids encode, with as many prompt tokens."""
    text = app["client"].completions.create(model=NAME, prompt="Hello, troupe", max_tokens=10,
                                            temperature=0)
    ids = list("Hello, troupe".encode())
    for prompt in (ids, [ids]):
        out = app["client"].completions.create(model=NAME, prompt=prompt, max_tokens=10,
                                               temperature=0)
        assert out.choices[0].text == text.choices[0].text
        assert out.usage.prompt_tokens == len(ids)


def test_several_prompts_in_one_request_answer_as_one_by_one(app):
    """OpenAI's list of prompts (text or token ids): prompt i's n choices at indices i * n + j,
    each what a request for that prompt alone gets; usage counts every prompt once; streamed,
    the same text per index."""
    prompts = ["Hello", "abc", "request 7: xyz"]
    ask = dict(model=NAME, max_tokens=7, temperature=1.0, seed=5, n=2)
    many = app["client"].completions.create(prompt=prompts, **ask)
    assert [c.index for c in many.choices] == list(range(6))
    for i, prompt in enumerate(prompts):
        alone_ = app["client"].completions.create(prompt=prompt, **ask)
        assert [c.text for c in many.choices[2 * i:2 * i + 2]] == \
            [c.text for c in alone_.choices]
    assert many.usage.prompt_tokens == sum(len(p.encode()) for p in prompts)
    as_ids = app["client"].completions.create(prompt=[list(p.encode()) for p in prompts], **ask)
    assert [c.text for c in as_ids.choices] == [c.text for c in many.choices]
    parts = list(app["client"].completions.create(prompt=prompts, stream=True,
                                                  stream_options={"include_usage": True}, **ask))
    for c in many.choices:
        assert "".join(p.choices[0].text for p in parts
                       if p.choices and p.choices[0].index == c.index) == c.text
    assert parts[-1].usage.prompt_tokens == many.usage.prompt_tokens


def test_return_token_ids_gives_the_tokens_that_ran(app):
    """vLLM's return_token_ids: the prompt's ids and each choice's generated ids (what the
    engine chose, the end-of-text included), whole or streamed."""
    ask = dict(model=NAME, prompt=["Hello", "abc"], max_tokens=9, temperature=1.0, seed=2,
               n=2, extra_body={"return_token_ids": True})
    whole = app["client"].completions.create(**ask).model_dump()
    for c in whole["choices"]:
        prompt = ["Hello", "abc"][c["index"] // 2]
        assert c["prompt_token_ids"] == list(prompt.encode())
        assert bytes(t for t in c["token_ids"] if t < 256).decode("utf-8", "replace") == \
            c["text"]
    assert sum(len(c["token_ids"]) for c in whole["choices"]) == \
        whole["usage"]["completion_tokens"]
    parts = [p.model_dump() for p in app["client"].completions.create(stream=True, **ask)]
    for c in whole["choices"]:
        mine = [p["choices"][0] for p in parts if p["choices"][0]["index"] == c["index"]]
        assert mine[0]["prompt_token_ids"] == c["prompt_token_ids"]
        assert all("prompt_token_ids" not in m for m in mine[1:])
        assert [t for m in mine for t in m["token_ids"]] == c["token_ids"]
    chat = app["client"].chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0,
        extra_body={"return_token_ids": True}).model_dump()
    assert chat["prompt_token_ids"] == list("user: Hi\nassistant:".encode())
    assert bytes(t for t in chat["choices"][0]["token_ids"] if t < 256).decode() == \
        chat["choices"][0]["message"]["content"]
    plain = app["client"].completions.create(model=NAME, prompt="abc", max_tokens=3).model_dump()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]


def test_tokenize_and_detokenize_are_the_tokens_requests_run(app):
    """POST /tokenize gives the ids a completion or a chat request runs (its usage counts
    them), /detokenize their text; both behind the key, bad input named."""
    code, out = post(app["url"], json.dumps({"model": NAME, "prompt": "Hello"}).encode(),
                     path="/tokenize")
    assert code == 200 and out == {"count": 5, "max_model_len": 96,
                                   "tokens": list(b"Hello")}
    messages = [{"role": "user", "content": "Hi"}]
    code, out = post(app["url"], json.dumps({"model": NAME, "messages": messages}).encode(),
                     path="/tokenize")
    chat = app["client"].chat.completions.create(model=NAME, messages=messages, max_tokens=2)
    assert code == 200 and out["count"] == chat.usage.prompt_tokens
    # a template's variables pass through (the byte format has no template: the same ids)
    code, same = post(app["url"], json.dumps({"model": NAME, "messages": messages,
                                              "chat_template_kwargs": {"enable_thinking": False}
                                              }).encode(), path="/tokenize")
    assert code == 200 and same == out
    code, out = post(app["url"], json.dumps({"model": NAME, "tokens": out["tokens"]}).encode(),
                     path="/detokenize")
    assert code == 200 and out == {"prompt": "user: Hi\nassistant:"}
    for path, body, words in [
            ("/tokenize", {"model": NAME}, "give a prompt or messages"),
            ("/tokenize", {"model": "other", "prompt": "x"}, "not served here"),
            ("/tokenize", {"model": NAME, "messages": messages,
                           "chat_template_kwargs": {"tools": []}},
             "chat_template_kwargs: 'tools' is set by the request itself"),
            ("/detokenize", {"model": NAME, "tokens": [300]}, "tokens.0: token 300"),
            ("/detokenize", {"model": NAME, "tokens": [-1]}, "tokens.0")]:
        code, out = post(app["url"], json.dumps(body).encode(), path=path)
        assert code in (400, 404) and words in out["error"]["message"], out
    code, _ = post(app["url"], json.dumps({"model": NAME, "prompt": "x"}).encode(),
                   key="wrong", path="/tokenize")
    assert code == 401


def test_logit_bias_and_penalties_reach_the_sampler(app):
    """OpenAI's logit_bias and penalties, and vLLM's repetition_penalty and top_k (through the
    client's extra_body), give what the engine gives with them alone."""
    ask = dict(model=NAME, prompt="abc", max_tokens=8, temperature=0)
    forced = app["client"].completions.create(logit_bias={str(ord("z")): 100}, **ask)
    assert forced.choices[0].text == "z" * 8
    penalised = app["client"].completions.create(frequency_penalty=1.5, presence_penalty=0.5,
                                                 extra_body={"repetition_penalty": 1.4}, **ask)
    want = alone(app["model"], "abc", 8, frequency_penalty=1.5, presence_penalty=0.5,
                 repetition_penalty=1.4)
    assert penalised.choices[0].text == want != alone(app["model"], "abc", 8)
    chat = app["client"].chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0,
        logit_bias={str(ord("q")): 100})
    assert chat.choices[0].message.content == "qqqq"
    z = str(ord("z"))
    ended = app["client"].completions.create(logit_bias={z: 100}, extra_body={
        "stop_token_ids": [ord("z")], "min_tokens": 3}, **ask)  # z is banned 3 tokens long
    assert (ended.choices[0].text, ended.choices[0].finish_reason) == (
        alone(app["model"], "abc", 3, logit_bias={ord("z"): 100}, min_tokens=3,
              stop_token_ids=(ord("z"),)), "stop")
    assert ended.usage.completion_tokens == 4  # the stop token counts, as the end-of-text does
    ask_eos = dict(ask, logit_bias={"256": 100})  # the byte model's end-of-text, forced
    assert app["client"].completions.create(**ask_eos).usage.completion_tokens == 1
    forever = app["client"].completions.create(extra_body={"ignore_eos": True}, **ask_eos)
    assert forever.usage.completion_tokens == 8 and forever.choices[0].finish_reason == "length"
    sampled = app["client"].completions.create(
        model=NAME, prompt="abc", max_tokens=8, temperature=1.5, seed=4, extra_body={"top_k": 2})
    assert sampled.choices[0].text == alone(app["model"], "abc", 8, temperature=1.5, seed=4,
                                            top_k=2)


def test_n_choices_match_seeded_single_requests(app):
    """n > 1: n choices, choice i the same as one request with seed + i; streamed, the same
    text per index; with include_usage a last chunk carries the usage."""
    ask = dict(model=NAME, prompt="abc", max_tokens=10, temperature=1.0)
    many = app["client"].completions.create(n=3, seed=7, **ask)
    assert [c.index for c in many.choices] == [0, 1, 2]
    for i, c in enumerate(many.choices):
        assert c.text == app["client"].completions.create(seed=7 + i, **ask).choices[0].text
    assert len({c.text for c in many.choices}) > 1
    parts = list(app["client"].completions.create(n=3, seed=7, stream=True,
                                                  stream_options={"include_usage": True}, **ask))
    for i, c in enumerate(many.choices):
        assert "".join(p.choices[0].text for p in parts if p.choices
                       and p.choices[0].index == i) == c.text
    assert parts[-1].choices == [] and parts[-1].usage.completion_tokens == \
        many.usage.completion_tokens


def test_metrics_parse_and_count_the_requests_sent(app):
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict:
        req = urllib.request.Request(app["url"] + "/metrics",
                                     headers={"Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.headers["Content-Type"].startswith("text/plain")
            text = r.read().decode()
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    ok = ("troupe_requests_total", (("outcome", "ok"), ("route", "/v1/completions")))
    before = scrape()
    for i in range(3):
        app["client"].completions.create(model=NAME, prompt=f"count {i}", max_tokens=4,
                                         temperature=0)
    after = scrape()
    assert after[ok] - before.get(ok, 0) == 3
    assert after[("troupe_prompt_tokens_total", ())] - \
        before[("troupe_prompt_tokens_total", ())] == 3 * len(b"count 0")
    ttft = ("troupe_time_to_first_token_seconds_count", ())
    assert after[ttft] - before[ttft] == 3
    assert after[("troupe_generation_tokens_total", ())] - \
        before[("troupe_generation_tokens_total", ())] >= 3
    assert after[("troupe_requests_running", ())] == 0
    assert 0 <= after[("troupe_kv_cache_usage_ratio", ())] <= 1


def test_chat_without_max_tokens_runs_to_the_servers_limit_not_16(app):
    """A chat request without max_tokens is not cut at the completions API's 16: it runs until
    the model stops, the server's limits.max_tokens (40 here) or the context, whichever comes
    first (the tiny random model never says its end-of-text, so the limit ends it); a plain
    completion keeps OpenAI's default of 16."""
    chat = app["client"].chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Hi"}], temperature=0)
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 40
    plain = app["client"].completions.create(model=NAME, prompt="Hi", temperature=0)
    assert plain.usage.completion_tokens == 16


def test_chat_content_parts_are_joined_and_other_part_types_named(app):
    """OpenAI's clients send content as an array of parts: the text parts are the message's
    text, joined by newlines (the same answer as the joined string); an image part is a 400
    naming its type and the message it is in."""
    client = app["client"]
    ask = dict(model=NAME, max_tokens=6, temperature=0)
    parts = client.chat.completions.create(messages=[{"role": "user", "content": [
        {"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}], **ask)
    joined = client.chat.completions.create(
        messages=[{"role": "user", "content": "Hi\nthere"}], **ask)
    assert parts.choices[0].message.content == joined.choices[0].message.content
    assert parts.usage.prompt_tokens == joined.usage.prompt_tokens
    code, out = post(app["url"], json.dumps({"model": NAME, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    ).encode(), path="/v1/chat/completions")
    assert code == 400 and "'image_url'" in out["error"]["message"], out
    assert out["error"]["param"] == "messages.0.content"


def test_metrics_are_behind_the_key_and_health_answers_get_only(app):
    """With a key set, /metrics wants it like the API (metrics_open opens it for a scraper);
    /health stays open, to GET only."""
    def status(path, method="GET", key=None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        req = urllib.request.Request(app["url"] + path, method=method, headers=headers,
                                     data=b"{}" if method == "POST" else None)
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    assert status("/metrics") == 401 and status("/metrics", key="wrong") == 401
    assert status("/metrics", key=KEY) == 200
    assert status("/health") == 200 and status("/health", "POST") == 405
    assert status("/metrics", "POST", key=KEY) == 405


def test_a_burst_of_150_requests_never_has_more_than_max_concurrent_in_flight(app):
    """150 clients send whole requests at once against limits.max_concurrent 16: the replica
    never holds more than 16 (its own count, the check and the count with no await between
    them; before, requests whose bodies arrived together all passed the check), the others
    get 429, and the count returns to 0."""
    body = json.dumps({"model": NAME, "prompt": "burst", "max_tokens": 8,
                       "temperature": 0}).encode()
    seen, stop = [], False

    def watch():
        while not stop:
            with urllib.request.urlopen(app["url"] + "/health", timeout=30) as r:
                seen.append(json.loads(r.read())["in_flight"])

    start = threading.Barrier(150)  # every client sends at once (a pool's threads start
    # one by one: on 2 busy cores the first ones could be answered before the last one sent)

    def send(_):
        start.wait(timeout=60)
        return post(app["url"], body)

    with cf.ThreadPoolExecutor(151) as pool:
        watcher = pool.submit(watch)
        statuses = [code for code, _ in pool.map(send, range(150))]
        stop = True
        watcher.result()
    assert max(seen) <= 16 and max(seen) > 0, seen
    assert statuses.count(200) >= 16 and statuses.count(200) + statuses.count(429) == 150
    assert statuses.count(429) > 0
    with urllib.request.urlopen(app["url"] + "/health", timeout=30) as r:
        assert json.loads(r.read())["in_flight"] == 0
