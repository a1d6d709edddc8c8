"""troupe's OpenAI-compatible server against transformers' ``generate`` on SmolLM2-135M, same
threads, one run: generated tokens per second of a batch of chat requests.

    python benchmarks/serve_vs_hf.py [--model DIR] [--threads 2] [--batch 8] [--new-tokens 32]

The server (one replica on the embedded Ray, ``threads`` torch threads) gets ``batch`` chat
completions at once, greedy, from as many client threads; tokens/s is the completion tokens
the responses report over the wall time from the first request sent to the last answer (HTTP,
the chat template, prefill and detokenization included: what a client sees). transformers
generates the same chat-templated prompts as one left-padded batch on ``threads`` threads in
this process (tokens up to each sequence's eos). The server runs fp32 (the same tokens as
transformers expected; the line says how many match), W8A8 (troupe's INT8 kernel, 16
calibrated outlier channels a layer) and W4/8A16 (INT4 MLP, INT8 attention and output
projection, 16-bit tokens). llama.cpp, the other peer a user would pick, has no
prebuilt llama-cpp-python wheel on this machine's package index, so it is not measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import urllib.request
from pathlib import Path

import torch
import transformers

import troupe
from troupe.models import smollm2
from troupe.serving import deploy as serve
from troupe.serving.config import ServeConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_models import QUESTIONS, generate_theirs, prompts  # noqa: E402
from machine import machine  # benchmarks/machine.py, beside this script


def ask(url: str, question: str, n: int, out: list, i: int) -> None:
    body = json.dumps({"model": "smollm2", "max_tokens": n, "temperature": 0,
                       "messages": [{"role": "user", "content": question}]}).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        out[i] = json.loads(r.read())


def serve_batch(url: str, questions: list[str], n: int) -> tuple[float, list[dict]]:
    out: list = [None] * len(questions)
    threads = [threading.Thread(target=ask, args=(url, q, n, out, i))
               for i, q in enumerate(questions)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="a Hugging Face directory (default SmolLM2)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--port", type=int, default=8198)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    model_dir = a.model or str(smollm2.build())
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(a.batch)]

    torch.set_num_threads(a.threads)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    ids = prompts(tok, a.batch)
    generate_theirs(hf, tok, ids, 4)  # warm-up
    best_hf, theirs = 0.0, None
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        theirs = generate_theirs(hf, tok, ids, a.new_tokens)
        best_hf = max(best_hf, sum(map(len, theirs)) / (time.perf_counter() - t0))
    their_text = [tok.decode(t, skip_special_tokens=True) for t in theirs]
    del hf

    troupe.init(num_cpus=max(2, a.threads))
    modes = (("fp32", {}), ("w8a8", {"*": "w8a8"}),
             ("w4/8a16", {"*.attn.*": "w8a16", "*.ffn.*": "w4a16", "lm_head": "w8a16"}))
    for mode, rules in modes:
        cfg = ServeConfig(model={"pretrained": model_dir, "name": "smollm2"}, quantize=rules,
                          port=a.port, threads=a.threads, num_cpus=a.threads,
                          limits={"max_batch": a.batch, "max_concurrent": a.batch})
        url = serve.deploy(cfg)
        try:
            serve_batch(url, questions[:2], 4)  # warm-up
            best, answers = 0.0, None
            for _ in range(a.repeats):
                wall, answers = serve_batch(url, questions, a.new_tokens)
                tokens = sum(r["usage"]["completion_tokens"] for r in answers)
                best = max(best, tokens / wall)
        finally:
            serve.shutdown()
        ours = [r["choices"][0]["message"]["content"] for r in answers]
        same = sum(o.strip() == t.strip() for o, t in zip(ours, their_text))
        print(json.dumps({
            "bench": "serve_vs_hf", "machine": machine(), "model": model_dir,
            "threads": a.threads, "batch": a.batch, "max_new_tokens": a.new_tokens,
            "server_quantize": mode, "server_tokens_per_s": round(best, 1),
            "transformers_tokens_per_s": round(best_hf, 1),
            "speedup": round(best / best_hf, 2),
            "same_text_as_transformers": f"{same}/{a.batch}",
            "llama_cpp": "not measured: no prebuilt llama-cpp-python wheel here"}), flush=True)


if __name__ == "__main__":
    main()
