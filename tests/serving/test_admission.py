"""Admission (troupe.serving.admission) and a replica's event loop, in this process, without
Ray: bodies sent whole need no receiving place, trickled ones are dropped at the minimum rate,
places go first come first served and never past the limit, and a request's rendering and
tokenizing leave the event loop free (issue 37: a ~1 MB chat body stalled every stream)."""

import asyncio
import json
import time

import pytest
import torch

from troupe.models import GPT, GPTConfig
from troupe.serving import admission
from troupe.serving.admission import Admission
from troupe.serving.config import Limits
from troupe.serving.model import save_model
from troupe.serving.protocol import RequestError
from troupe.serving.replica import ServeReplica


def whole(body: bytes):
    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}
    return receive


def trickle(chunk: bytes, chunks: int, every_s: float):
    """A body of ``chunks`` pieces, one every ``every_s`` seconds after the first."""
    sent = 0

    async def receive():
        nonlocal sent
        if sent:
            await asyncio.sleep(every_s)
        sent += 1
        return {"type": "http.request", "body": chunk, "more_body": sent < chunks}
    return receive


def test_a_body_sent_whole_needs_no_receiving_place():
    adm = Admission(Limits(max_receiving=1))
    adm.receiving = 1  # every receiving place taken by slow senders
    assert asyncio.run(adm.body(whole(b'{"a": 1}'))) == b'{"a": 1}'
    with pytest.raises(RequestError) as e:  # one that trickles needs a place: none is left
        asyncio.run(adm.body(trickle(b"x", 5, 0.01)))
    assert e.value.status == 429 and "still sending" in e.value.message


@pytest.fixture
def grace(monkeypatch):
    """A shorter grace than the server's 3 s, to keep these tests quick."""
    monkeypatch.setattr(admission, "GRACE_S", 0.5)
    return 0.5


def test_a_trickled_body_is_dropped_at_the_minimum_rate(grace):
    adm = Admission(Limits(min_body_rate=100, body_timeout_s=30))
    t0 = time.monotonic()
    with pytest.raises(RequestError) as e:  # 5 bytes/s against 100 bytes/s
        asyncio.run(adm.body(trickle(b"x", 1000, 0.2)))
    took = time.monotonic() - t0
    assert e.value.status == 408 and "under 100 bytes/s" in e.value.message
    assert grace <= took < grace + 0.5 and adm.receiving == 0


def test_a_late_first_part_is_not_held_to_the_rate(grace):
    """The first part waits on the proxy as much as on the client: it has body_timeout_s."""
    async def late():
        await asyncio.sleep(3 * grace)
        return {"type": "http.request", "body": b"{}", "more_body": False}

    adm = Admission(Limits(min_body_rate=100, body_timeout_s=30))
    assert asyncio.run(adm.body(late)) == b"{}"
    with pytest.raises(RequestError) as e:
        asyncio.run(Admission(Limits(body_timeout_s=0.2)).body(late))
    assert e.value.status == 408 and "within 0.2s" in e.value.message


def test_a_body_above_the_minimum_rate_is_read_whole(grace):
    adm = Admission(Limits(min_body_rate=100, body_timeout_s=30))
    body = asyncio.run(adm.body(trickle(b"y" * 60, 10, 0.25)))  # 240 bytes/s for 2.5 s
    assert body == b"y" * 600 and adm.receiving == 0


def test_places_go_first_come_first_served_and_never_past_the_limit():
    async def main():
        adm = Admission(Limits(max_concurrent=2, max_queued=3, queue_timeout_s=10))
        held = [await adm.place(), await adm.place()]
        order, peak = [], []

        async def waiter(i):
            place = await adm.place()
            order.append(i)
            peak.append(adm.in_flight)
            await asyncio.sleep(0.01)
            place.release()

        tasks = []
        for i in range(3):
            tasks.append(asyncio.ensure_future(waiter(i)))
            await asyncio.sleep(0)  # queued in this order
        await asyncio.sleep(0.01)
        assert adm.queued == 3 and adm.in_flight == 2
        with pytest.raises(RequestError) as e:  # queue full: 429 at once, before any body
            adm.refuse_if_full()
        assert e.value.status == 429
        with pytest.raises(RequestError):
            await adm.place()
        for place in held:
            place.release()
            place.release()  # idempotent
        await asyncio.gather(*tasks)
        return adm, order, peak

    adm, order, peak = asyncio.run(main())
    assert order == [0, 1, 2] and max(peak) <= 2
    assert adm.in_flight == 0 and adm.queued == 0


def test_a_wait_times_out_with_429_and_a_cancelled_waiter_keeps_no_place():
    async def main():
        adm = Admission(Limits(max_concurrent=1, max_queued=4, queue_timeout_s=0.2))
        first = await adm.place()
        with pytest.raises(RequestError) as e:
            await adm.place()
        assert e.value.status == 429 and "within 0.2s" in e.value.message
        gone = asyncio.ensure_future(adm.place())  # a client that leaves while it waits
        await asyncio.sleep(0.05)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        first.release()
        assert adm.in_flight == 0 and adm.queued == 0
        again = await adm.place()  # the place is free, not held by the one that left
        again.release()
        return adm

    adm = asyncio.run(main())
    assert adm.in_flight == 0


def _request(method: str, path: str, body: bytes = b""):
    from starlette.requests import Request

    scope = {"type": "http", "method": method, "path": path, "query_string": b"",
             "root_path": "", "scheme": "http", "server": ("test", 80),
             "headers": [(b"content-type", b"application/json")]}
    return Request(scope, whole(body))


@pytest.fixture
def replica(tmp_path):
    path = tmp_path / "m.trp"
    save_model(GPT(GPTConfig(seq_len=64, n_layer=1, n_head=2, d_model=32), seed=1), path)
    threads = torch.get_num_threads()  # the replica sets its own: give this process's back
    try:
        yield ServeReplica({"model": {"file": str(path), "name": "m"}, "quantize": {},
                            "api_key_env": "TROUPE_TEST_NO_KEY",
                            "limits": {"max_prompt_tokens": 40, "max_tokens": 8}})
    finally:
        torch.set_num_threads(threads)


def test_rendering_a_prompt_leaves_the_event_loop_free(replica):
    """A chat request whose template takes a second (blocking, as rendering a huge body does)
    delays /health by nothing: before, it ran on the event loop and /health waited it out."""
    render = replica.tok.chat

    def slow_chat(messages, *args, **kwargs):  # the tokenizer's signature (tools, ...)
        time.sleep(1.0)
        return render(messages, *args, **kwargs)

    replica.tok.chat = slow_chat
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 2}).encode()

    async def main():
        t0 = time.monotonic()
        chat = asyncio.ensure_future(replica(_request("POST", "/v1/chat/completions", body)))
        await asyncio.sleep(0.05)
        health = await replica(_request("GET", "/health"))
        health_s = time.monotonic() - t0
        return health, health_s, await chat

    health, health_s, chat = asyncio.run(main())
    assert health.status_code == 200 and health_s < 0.5, health_s
    assert chat.status_code == 200, chat.body


def test_a_template_kwarg_that_spells_a_control_token_is_a_400_naming_it(replica, tmp_path):
    """chat_template_kwargs reach the model's template (here the byte tokenizer saved as a
    Hugging Face one, with a template that renders bos_token); one that would put a control
    token into the template's text is refused as a 400 naming chat_template_kwargs."""
    from troupe.data import ByteTokens, HFTokens
    ByteTokens().save_pretrained(tmp_path / "tok")  # a directory it makes
    replica.tok = replica.prompts.tok = HFTokens(
        tmp_path / "tok", template="{{ bos_token }}{% for m in messages %}{{ m['content'] }}"
                                   "{% endfor %}")
    answers = []
    for bos in ("plain ", "<|endoftext|>"):
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                           "max_tokens": 2, "chat_template_kwargs": {"bos_token": bos}})
        answers.append(asyncio.run(replica(_request("POST", "/v1/chat/completions",
                                                    body.encode()))))
    assert answers[0].status_code == 200, answers[0].body
    assert json.loads(answers[0].body)["usage"]["prompt_tokens"] == len("plain hi")
    error = json.loads(answers[1].body)["error"]
    assert answers[1].status_code == 400 and error["param"] == "chat_template_kwargs"
    assert "chat_template_kwargs.bos_token: holds the control token" in error["message"]


def test_a_prompt_far_over_the_limit_is_refused_before_it_is_tokenized(replica):
    def never(_):
        raise AssertionError("tokenized")

    replica.tok.chat = replica.tok.encode = never
    for path, body in [("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "x" * 100_000}]}),
                       ("/v1/completions", {"prompt": "x" * 100_000})]:
        answer = asyncio.run(replica(_request("POST", path, json.dumps({"model": "m", **body})
                                              .encode())))
        error = json.loads(answer.body)["error"]
        assert answer.status_code == 400 and "100" in error["message"], error
        assert "characters" in error["message"] and error["param"] in ("messages", "prompt")


def test_a_prompt_over_the_limit_is_refused_after_tokenizing_a_prefix(replica):
    """1000 characters against 40 tokens (under the character bound): the replica tokenizes
    160 characters (4 a token), finds them over the limit and refuses without tokenizing the
    rest; a prompt within the limit is tokenized whole, once."""
    seen, encode = [], replica.tok.encode

    def counting(text):
        seen.append(len(text))
        return encode(text)

    replica.tok.encode = counting
    answer = asyncio.run(replica(_request("POST", "/v1/completions", json.dumps(
        {"model": "m", "prompt": "x" * 1000}).encode())))
    error = json.loads(answer.body)["error"]
    assert answer.status_code == 400 and "more than 159 tokens" in error["message"], error
    assert seen == [160]
    seen.clear()
    answer = asyncio.run(replica(_request("POST", "/v1/completions", json.dumps(
        {"model": "m", "prompt": "x" * 20, "max_tokens": 2}).encode())))
    assert answer.status_code == 200 and seen == [20]
