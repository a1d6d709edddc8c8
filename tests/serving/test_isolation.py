"""One bad request does not fail the batch (issue 14): 8 normal requests and 4 poisoned ones
at once; the normal ones get the text they get alone, the poisoned ones are made safe (a
temperature of 1e-300 is greedy, a seed of 2**64 is taken modulo 2**64) or end alone with an
error (a prompt that drives the model to non-finite logits: here a model whose position 40 is
NaN, as corrupted weights would be), and the server serves afterwards."""

import concurrent.futures as cf
import json
import socket
import time
import urllib.error
import urllib.request

import pytest
import torch

from troupe.generation import ContinuousBatcher, SamplingParams
from troupe.models import GPT, GPTConfig
from troupe.serving import deploy as serve
from troupe.serving.config import ServeConfig
from troupe.serving.model import load_served_model, save_model

N = 10


@pytest.fixture(scope="module")
def app(cluster, serve_port, tmp_path_factory):
    model = GPT(GPTConfig(seq_len=64, n_layer=2, n_head=2, d_model=32), seed=4)
    with torch.no_grad():
        model.pos_emb.weight[40] = float("nan")
    path = tmp_path_factory.mktemp("poisoned") / "model.trp"
    save_model(model, path)
    cfg = ServeConfig(model={"file": str(path), "name": "m"}, port=serve_port,
                      limits={"max_tokens": N, "max_prompt_tokens": 50, "max_batch": 16,
                              "max_concurrent": 32, "body_timeout_s": 3, "max_receiving": 120,
                              "min_body_rate": 1})
    url = serve.deploy(cfg)
    yield url, load_served_model(cfg)[0]
    serve.shutdown()


def alone(model, prompt: str, params: SamplingParams) -> str:
    engine = ContinuousBatcher(model, 256, max_batch=1)
    engine.add("x", list(prompt.encode()), params)
    return "".join(e.delta for e in engine.run_events())


def post(url: str, body: dict) -> tuple[int, dict | str]:
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            text = r.read().decode()
            return r.status, text if body.get("stream") else json.loads(text)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_poisoned_requests_do_not_fail_the_batch(app):
    url, model = app
    normal = [{"model": "m", "prompt": f"normal request {i}", "max_tokens": N, "temperature": 0}
              for i in range(8)]
    long_prompt = "x" * 45  # reaches position 40: non-finite logits
    poisoned = [
        {"model": "m", "prompt": "tiny temperature", "max_tokens": N, "temperature": 1e-300},
        {"model": "m", "prompt": "huge seed", "max_tokens": N, "temperature": 0.7,
         "seed": 2 ** 64},
        {"model": "m", "prompt": long_prompt, "max_tokens": N},
        {"model": "m", "prompt": long_prompt, "max_tokens": N, "stream": True},
    ]
    with cf.ThreadPoolExecutor(12) as pool:
        got = list(pool.map(lambda b: post(url, b), normal + poisoned))
    for body, (status, out) in zip(normal, got[:8]):
        assert status == 200, out
        assert out["choices"][0]["text"] == alone(model, body["prompt"], SamplingParams(N))
    (s_t, tiny_t), (s_seed, seed), (s_nan, nan), (s_stream, stream) = got[8:]
    assert s_t == 200 and tiny_t["choices"][0]["text"] == alone(model, "tiny temperature",
                                                                SamplingParams(N))
    assert s_seed == 200 and seed["choices"][0]["text"] == alone(
        model, "huge seed", SamplingParams(N, temperature=0.7, seed=0))
    assert s_nan == 500 and "non-finite logits" in nan["error"]["message"]
    assert s_stream == 200 and '"error"' in stream and "non-finite logits" in stream
    assert stream.rstrip().endswith("data: [DONE]")
    status, out = post(url, normal[0])  # and it serves afterwards, nothing left in flight
    assert status == 200 and out["choices"][0]["text"] == got[0][1]["choices"][0]["text"]
    with urllib.request.urlopen(f"{url}/health", timeout=30) as r:
        assert json.loads(r.read())["in_flight"] == 0


def _slow_sender(url: str) -> socket.socket:
    """A connection that sends its headers, announces a 1000-byte body and sends two bytes
    (at limits.min_body_rate 1 byte/s, held until body_timeout_s, 3 s)."""
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 1000\r\n\r\n{\"")
    return s


def _answer(s: socket.socket) -> str:
    """The whole HTTP answer on ``s`` (head and body may come in separate packets)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(4096)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += s.recv(4096)
    return (head + b"\r\n\r\n" + body).decode(errors="replace")


def test_slow_bodies_do_not_starve_the_server(app):
    """100 connections trickling their bodies hold no generation slot: a normal request is
    answered within 2 s; the slow ones get 408 once body_timeout_s (3 s here) has passed."""
    url, model = app
    slow = [_slow_sender(url) for _ in range(100)]
    try:
        time.sleep(1)
        t0 = time.perf_counter()
        status, out = post(url, {"model": "m", "prompt": "hello", "max_tokens": 4,
                                 "temperature": 0})
        assert status == 200 and time.perf_counter() - t0 < 2.0
        time.sleep(3)
        answer = slow[0].recv(200).decode(errors="replace")
        assert answer.startswith("HTTP/1.1 408"), answer
    finally:
        for s in slow:
            s.close()


def test_slow_senders_take_receiving_places_and_whole_bodies_need_none(app):
    """125 connections trickle their bodies against max_receiving 120: one more slow sender
    gets 429 with Retry-After, while a normal request, whose body comes whole with its headers,
    is answered (before, it got 429 too: every body waited for a receiving place)."""
    url, _ = app
    slow = [_slow_sender(url) for _ in range(125)]
    try:
        time.sleep(0.5)
        one_more = _slow_sender(url)
        slow.append(one_more)
        answer = _answer(one_more)
        assert answer.startswith("HTTP/1.1 429"), answer
        assert "retry-after: 1" in answer.lower() and "still sending their bodies" in answer
        status, out = post(url, {"model": "m", "prompt": "hello", "max_tokens": 4,
                                 "temperature": 0})
        assert status == 200, out
    finally:
        for s in slow:
            s.close()
