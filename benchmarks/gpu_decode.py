"""Decoding on a GPU: troupe's engine (eager, and its fixed-shape step captured as CUDA graphs
per batch bucket, troupe.generation.static_step) against transformers in the same run.

    python benchmarks/gpu_decode.py [--shapes smollm2 llama1b] [--batches 1 8 64]
                                    [--prompt 128] [--new 128] [--out DIR]
    python benchmarks/gpu_decode.py --smoke      # tiny shapes on the CPU: the script works

Random-weight models of SmolLM2-135M's and Llama-3.2-1B's shapes (Llama architecture), bf16,
greedy, ``--prompt`` random prompt tokens and ``--new`` new tokens a row. Decode tokens per
second (the first step, the prefill, left out: each side's total minus its prefill's time) for:
transformers eager (``generate``), transformers with its static cache and a compiled forward
(batch 1, on the 1B shape only: the compile costs minutes), troupe's eager engine and troupe's
captured step. At batch 1 a decode step reads every weight once: the bound is the weights'
bytes over the device's copy bandwidth (a 1 GiB copy timed in the same run). One JSON line
per figure, printed and appended to DIR/gpu_decode.jsonl as soon as it is made (most
important first: the captured step and transformers eager at every point, then the rest).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import transformers

from troupe.generation import ContinuousBatcher, SamplingParams
from troupe.models.hf import from_pretrained

SHAPES = {  # Llama-architecture configurations of the two models
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                    tie_word_embeddings=True, rope_theta=100000.0),
    "llama1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                    tie_word_embeddings=True, rope_theta=500000.0),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                 tie_word_embeddings=True),
}


def emit(line: dict, out: Path | None) -> None:
    print(json.dumps(line), flush=True)
    if out is not None:
        with open(out / "gpu_decode.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def models(shape: str, device: str, dtype: torch.dtype, tmp: Path, context: int):
    """The transformers model (random weights) and troupe's GPT of the same weights."""
    config = transformers.LlamaConfig(**SHAPES[shape], max_position_embeddings=context,
                                      torch_dtype=str(dtype).split(".")[-1])
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).to(dtype)
    where = tmp / shape
    hf.save_pretrained(where)
    ours = from_pretrained(where, dtype=dtype).to(device).eval()
    return hf.to(device).eval(), ours


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read and written)."""
    n = (1 << 30) // 2 if device == "cuda" else 1 << 26
    a = torch.empty(n, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    sync(device)
    t = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    sync(device)
    return 2 * a.numel() * a.element_size() * 5 / (time.perf_counter() - t)


def troupe_rate(model, prompts: list[list[int]], new: int, static: bool, device: str,
                compile: str | None) -> tuple[float, float]:
    """(decode tokens/s, seconds to build and warm up) of troupe's engine on ``prompts``."""
    t = time.perf_counter()
    engine = ContinuousBatcher(model, None, max_batch=len(prompts), static=static,
                               compile=compile, static_len=len(prompts[0]) + new)
    for warm in range(2):  # the first run compiles and captures every bucket it meets
        for i, p in enumerate(prompts):
            engine.add(f"{warm}-{i}", p, SamplingParams(max_tokens=new))
        engine.step()  # the prefill
        sync(device)
        if warm == 0:
            engine.run()
            sync(device)
            built = time.perf_counter() - t
            continue
        t0 = time.perf_counter()
        steps = 0
        while engine.has_work():
            engine.step()
            steps += 1
        sync(device)
        return len(prompts) * (new - 1) / (time.perf_counter() - t0), built


def hf_rate(hf, ids: torch.Tensor, new: int, device: str, **kw) -> float:
    """Decode tokens/s of transformers' generate: the whole call less its prefill's time."""
    def timed(n):
        sync(device)
        t = time.perf_counter()
        hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                    pad_token_id=0, **kw)
        sync(device)
        return time.perf_counter() - t
    timed(2)  # warm-up (and the compile, with a compiled forward)
    prefill, whole = timed(1), timed(new)
    return ids.shape[0] * (new - 1) / (whole - prefill)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["smollm2", "llama1b"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64])
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--out", default=os.environ.get("OUT"))
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, eager")
    a = p.parse_args()
    device = "cpu" if a.smoke else "cuda"
    shapes, batches = (["tiny"], [1, 4]) if a.smoke else (a.shapes, a.batches)
    prompt, new = (8, 6) if a.smoke else (a.prompt, a.new)
    out = Path(a.out) if a.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    dtype = torch.float32 if a.smoke else torch.bfloat16
    compile = None if a.smoke else "reduce-overhead"
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    bandwidth = copy_bandwidth(device)
    emit({"bench": "gpu_decode", "device": name, "copy_GBps": bandwidth / 1e9}, out)
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / "troupe-gpu-decode"
    for shape in shapes:
        hf, ours = models(shape, device, dtype, tmp, prompt + new + 8)
        weight_bytes = sum(t.numel() * t.element_size() for t in ours.state_dict().values())
        g = torch.Generator().manual_seed(1)
        V = SHAPES[shape]["vocab_size"]
        for B in batches:
            ids = torch.randint(3, V, (B, prompt), generator=g)
            prompts = ids.tolist()
            head = {"bench": "gpu_decode", "device": name, "shape": shape, "batch": B,
                    "prompt": prompt, "new": new, "dtype": str(dtype).split(".")[-1]}
            graphs, built = troupe_rate(ours, prompts, new, True, device, compile)
            eager_hf = hf_rate(hf, ids.to(device), new, device)
            line = {**head, "troupe_graphs_tok_s": graphs, "troupe_build_s": built,
                    "hf_eager_tok_s": eager_hf, "vs_hf_eager": graphs / eager_hf}
            if B == 1:
                bound = bandwidth / weight_bytes
                line.update(hbm_bound_tok_s=bound, of_bound=graphs / bound)
            emit(line, out)
            eager, _ = troupe_rate(ours, prompts, new, False, device, None)
            emit({**head, "troupe_eager_tok_s": eager, "graphs_vs_eager": graphs / eager}, out)
            if B == 1 and shape == "llama1b" and not a.smoke:
                hf.generation_config.cache_implementation = "static"
                hf.forward = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
                compiled = hf_rate(hf, ids.to(device), new, device)
                emit({**head, "hf_compiled_tok_s": compiled, "vs_hf_compiled": graphs / compiled},
                     out)
        del hf, ours
        if device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
