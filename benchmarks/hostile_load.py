"""The OpenAI-compatible server under hostile load (issue 37's findings), one JSON line per
measurement, each beside the figure it is judged against, measured in the same run.

    python benchmarks/hostile_load.py [--scenarios bodies slow retry burst expert decode]
                                      [--seconds 15]

The model: a small troupe GPT (4 layers, d=256, W8A8) written as a Hugging Face directory with
troupe's byte tokenizer, so that chat requests go through a real Jinja chat template and a
real `tokenizers` tokenizer; one replica on the embedded Ray.

- bodies: 4 streaming chats alone, then the same 4 while 8 clients post ~0.9 MB chat bodies
  (once with the default max_prompt_tokens, refused by their length before rendering; once
  with max_prompt_tokens 32768, rendered and tokenized on the replica's thread pool): the
  streams' latency against their unloaded latency.
- slow: 300 clients that announce a 1000-byte body and send a byte every 0.5 s, reconnecting
  at once when dropped (with the API key, then without it); 40 normal requests meanwhile.
- retry: goodput (completions/s) of 32 clients that never retry, then of 64 and 128 that
  resend every 429 at once, at max_concurrent 32 (default queue: max_queued 64), and the same
  with max_queued 0 (a 429 as soon as the places are taken); at max_concurrent 16 with no
  queue, 16 clients that never retry against 32 and 64 that do (the condition of the former
  serve_goodput benchmark, which compared 32 retrying clients with 64).
- burst: 150 clients at once against max_concurrent 32; the most in flight /health saw.
- expert: a MoE model served over 2 expert actors; one rank's process killed: seconds until
  /health is not ok, and until a completion answers 200 again.
- decode: troupe.wire decoding a hostile 10 MB frame (10 M empty lists): peak Python memory.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import signal
import statistics
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import troupe
from troupe.data.tokenizer import ByteTokens
from troupe.models import GPT, GPTConfig
from troupe.models.hf import save_pretrained
from troupe.serving import deploy as serve
from troupe.serving.config import ServeConfig
from troupe.serving.model import save_model

from machine import machine  # benchmarks/machine.py, beside this script

KEY_ENV, KEY = "TROUPE_BENCH_KEY", "sk-hostile-load"
PORT = 8198


def emit(**fields) -> None:
    print(json.dumps({"bench": "hostile_load", "machine": machine(), **fields}), flush=True)


def model_dir(root: Path) -> Path:
    d = root / "hf-small"
    save_pretrained(GPT(GPTConfig(seq_len=256, n_layer=4, n_head=4, d_model=256), seed=0), d)
    ByteTokens().save_pretrained(d)
    return d


def deploy(model: Path, key: bool = False, **limits) -> None:
    if key:
        os.environ[KEY_ENV] = KEY  # deploy takes it out of the environment again
    cfg = ServeConfig(model={"pretrained": str(model), "name": "m"}, port=PORT,
                      api_key_env=KEY_ENV, limits={"max_tokens": 64, **limits})
    serve.deploy(cfg)


def request(body: dict, path: str = "/v1/chat/completions", key: str | None = None,
            timeout: float = 120) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(f"http://127.0.0.1:{PORT}{path}", method="POST",
                                 data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError as e:
        return 0, str(e).encode()


def in_threads(fn, n: int) -> list:
    out: list = [None] * n

    def one(i):
        out[i] = fn(i)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


# ---- bodies ----------------------------------------------------------------------------------
def streams(n: int = 4) -> list[float]:
    """Seconds each of ``n`` concurrent streaming chats takes to its end."""
    def one(i):
        t0 = time.monotonic()
        status, text = request({"model": "m", "stream": True, "max_tokens": 48,
                                "temperature": 0, "messages": [
                                    {"role": "user", "content": f"stream {i}: tell me"}]})
        assert status == 200 and text.rstrip().endswith(b"[DONE]"), (status, text[-200:])
        return time.monotonic() - t0
    return in_threads(one, n)


def bodies(model: Path) -> None:
    huge = {"model": "m", "messages": [{"role": "user", "content": "x" * 900_000}]}
    for max_prompt in (1024, 32768):
        deploy(model, max_prompt_tokens=max_prompt)
        streams()  # warm-up
        alone = statistics.median(streams())
        statuses: list[int] = []
        loaders = [threading.Thread(target=lambda: statuses.append(request(huge)[0]))
                   for _ in range(8)]
        for t in loaders:
            t.start()
        loaded = statistics.median(streams())
        for t in loaders:
            t.join()
        emit(scenario="bodies", max_prompt_tokens=max_prompt, body_bytes=900_000,
             huge_statuses=sorted(statuses), stream_s_alone=round(alone, 3),
             stream_s_loaded=round(loaded, 3), ratio=round(loaded / alone, 3))
        serve.shutdown()


# ---- slow senders ----------------------------------------------------------------------------
async def _slow_client(stop: float, key: str | None, counts: dict) -> None:
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: 1000\r\n")
    if key:
        head += f"Authorization: Bearer {key}\r\n".encode()
    while time.monotonic() < stop:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", PORT)
            writer.write(head + b"\r\n{")
            await writer.drain()
            counts["connections"] += 1
            while time.monotonic() < stop:
                try:
                    answer = await asyncio.wait_for(reader.read(100), 0.5)
                    if answer:
                        counts[answer.split(b" ")[1].decode()] = \
                            counts.get(answer.split(b" ")[1].decode(), 0) + 1
                    break  # answered (408, 401, 429) or closed: connect again at once
                except asyncio.TimeoutError:
                    writer.write(b" ")
                    await writer.drain()
            writer.close()
        except (OSError, IndexError):
            await asyncio.sleep(0.05)


def slow(model: Path, seconds: float) -> None:
    deploy(model, key=True)
    for with_key in (True, False):
        stop = time.monotonic() + seconds
        counts: dict = {"connections": 0}

        def attackers():
            async def main():
                await asyncio.gather(*[_slow_client(stop, KEY if with_key else None, counts)
                                       for _ in range(300)])
            asyncio.run(main())

        t = threading.Thread(target=attackers)
        t.start()
        time.sleep(3)  # every slow client connected and trickling
        normal = {"model": "m", "max_tokens": 8, "temperature": 0,
                  "messages": [{"role": "user", "content": "a normal request"}]}
        t0 = time.monotonic()
        answers = [a for batch in range(10)
                   for a in in_threads(lambda i: request(normal, key=KEY, timeout=60), 4)]
        took = time.monotonic() - t0
        got = [status for status, _ in answers]
        errors = sorted({body[:160].decode(errors="replace") for status, body in answers
                         if status != 200})
        t.join()
        emit(scenario="slow", slow_clients=300, slow_with_key=with_key,
             normal_ok=got.count(200), normal_total=len(got),
             normal_statuses=sorted(set(got)), normal_errors=errors,
             normal_seconds=round(took, 1),
             slow_answers={k: v for k, v in counts.items()})
    serve.shutdown()


# ---- retry storms ----------------------------------------------------------------------------
def _client(stop: float, retry: bool, counts: dict, lock: threading.Lock, i: int) -> None:
    body = json.dumps({"model": "m", "prompt": f"client {i:03d} asks", "max_tokens": 16,
                       "temperature": 0}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", PORT, timeout=60)
    ok = refused = failed = 0
    while time.monotonic() < stop:
        try:
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            r.read()
            if r.status == 200:
                ok += 1
            elif r.status == 429:
                refused += 1
                if not retry:
                    time.sleep(float(r.headers.get("Retry-After", 1)))
            else:
                failed += 1
        except (OSError, http.client.HTTPException):
            failed += 1
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", PORT, timeout=60)
    with lock:
        counts["ok"] += ok
        counts["refused"] += refused
        counts["failed"] += failed


def goodput(clients: int, retry: bool, seconds: float) -> dict:
    counts, lock = {"ok": 0, "refused": 0, "failed": 0}, threading.Lock()
    stop = time.monotonic() + seconds
    t0 = time.monotonic()
    in_threads(lambda i: _client(stop, retry, counts, lock, i), clients)
    wall = time.monotonic() - t0
    return {"clients": clients, "retry_at_once": retry,
            "goodput_rps": round(counts["ok"] / wall, 2),
            "refused_rps": round(counts["refused"] / wall, 2), "failed": counts["failed"]}


def retry(model: Path, seconds: float) -> None:
    for limit, queued, runs in [(32, 64, [(32, False), (64, True), (128, True)]),
                                (32, 0, [(32, False), (64, True)]),
                                (16, 0, [(16, False), (32, True), (64, True)])]:
        deploy(model, max_concurrent=limit, max_queued=queued)
        goodput(4, False, 3)  # warm-up
        base = None
        for clients, again in runs:
            r = goodput(clients, again, seconds)
            base = base or r["goodput_rps"]
            emit(scenario="retry", max_concurrent=limit, max_queued=queued, **r,
                 goodput_vs_no_retry=round(r["goodput_rps"] / base, 3))
        serve.shutdown()


# ---- burst -----------------------------------------------------------------------------------
def burst(model: Path) -> None:
    deploy(model, max_concurrent=32)
    seen, stop = [], False

    def watch():
        while not stop:
            with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=30) as r:
                seen.append(json.loads(r.read())["in_flight"])

    w = threading.Thread(target=watch)
    w.start()
    body = {"model": "m", "prompt": "burst", "max_tokens": 16, "temperature": 0}
    statuses = in_threads(lambda i: request(body, "/v1/completions")[0], 150)
    stop = True
    w.join()
    emit(scenario="burst", clients=150, max_concurrent=32, most_in_flight=max(seen),
         ok=statuses.count(200), refused=statuses.count(429))
    serve.shutdown()


# ---- a dead expert rank ----------------------------------------------------------------------
def expert(root: Path) -> None:
    import ray
    from ray.util.state import list_actors

    path = root / "moe.trp"
    moe = dict(num_experts=4, expert_interval=1, top_k=2, capacity_factor=1.0)
    save_model(GPT(GPTConfig(seq_len=64, n_layer=2, n_head=2, d_model=32, moe=moe), seed=5),
               path)
    serve.deploy(ServeConfig(model={"file": str(path), "name": "m"}, group_size=16, port=PORT,
                             expert_parallel=2, num_cpus=0.5, api_key_env=KEY_ENV))
    [pg] = [i for i, g in ray.util.placement_group_table().items()
            if g["name"].startswith("serve-") and g["state"] == "CREATED"]
    ranks = list_actors(filters=[("placement_group_id", "=", pg), ("state", "=", "ALIVE")],
                        detail=True, timeout=60)
    body = {"model": "m", "prompt": "moe", "max_tokens": 8, "temperature": 0}
    assert request(body, "/v1/completions")[0] == 200
    os.kill(ranks[-1].pid, signal.SIGKILL)
    killed = time.monotonic()

    def health() -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=2) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return 0

    while health() == 200 and time.monotonic() - killed < 30:
        time.sleep(0.1)
    unhealthy = time.monotonic() - killed
    statuses = []
    while time.monotonic() - killed < 180:
        status = request(body, "/v1/completions", timeout=10)[0]
        statuses.append(status)
        if status == 200:
            break
        time.sleep(0.25)
    back = time.monotonic() - killed
    emit(scenario="expert", health_not_ok_s=round(unhealthy, 2), service_back_s=round(back, 1),
         statuses_meanwhile=sorted(set(statuses)),
         old_gang_removed=ray.util.placement_group_table()[pg]["state"] == "REMOVED")
    serve.shutdown()


# ---- wire decode -----------------------------------------------------------------------------
def decode() -> None:
    import tracemalloc

    from troupe import wire
    from troupe.wire import WireFormatError

    n = (10 << 20) - 16
    # a frame whose header is [<a msgpack array of 10 M empty lists>, 0], as a hostile sender
    # writes it byte by byte
    header = b"\x92\xdd" + n.to_bytes(4, "big") + b"\x90" * n + b"\x00"
    head = wire.MAGIC + wire._HEADER_LEN.pack(len(header)) + header
    frame = head + bytes(wire._pad(len(head)))
    tracemalloc.start()
    try:
        wire.decode(frame)
        outcome = "decoded"
    except WireFormatError as e:
        outcome = str(e)[:80]
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    emit(scenario="decode", frame_mib=round(len(frame) / 2**20, 1),
         peak_mib=round(peak / 2**20, 1), outcome=outcome)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--scenarios", nargs="+", default=["decode", "bodies", "slow", "retry",
                                                      "burst", "expert"])
    p.add_argument("--seconds", type=float, default=15)
    a = p.parse_args()
    root = Path(tempfile.mkdtemp())
    if "decode" in a.scenarios:
        decode()
    troupe.init(num_cpus=4)
    model = model_dir(root)
    for name in a.scenarios:
        if name == "bodies":
            bodies(model)
        elif name == "slow":
            slow(model, a.seconds)
        elif name == "retry":
            retry(model, a.seconds)
        elif name == "burst":
            burst(model)
        elif name == "expert":
            expert(root)


if __name__ == "__main__":
    main()
