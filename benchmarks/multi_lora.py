"""Four LoRA adapters in one batch against the base model alone, on SmolLM2-135M-Instruct with
the server's engine.

    python benchmarks/multi_lora.py [--model DIR] [--batch 8] [--tokens 64] [--rank 16]
                                    [--rounds 3] [--quantize none|w8a8]

Four random adapters (rank ``--rank`` on all seven projections of every layer, as PEFT writes
them) are loaded over the model (troupe.models.adapters); ``--batch`` greedy sequences decode
with the base alone (no adapter loaded) and with the rows spread over the four adapters.
Prints decode tokens per second over the steps where the whole batch decodes, the median of
alternating rounds, and the ratio (the goal: at least 0.7).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from engine_rate import full_batch_rate  # noqa: E402  beside this script
from machine import machine  # noqa: E402  benchmarks/machine.py, beside this script

from troupe.compression import quantize_model  # noqa: E402
from troupe.data import load_tokenizer  # noqa: E402
from troupe.generation import ContinuousBatcher, SamplingParams  # noqa: E402
from troupe.models import from_pretrained  # noqa: E402
from troupe.models.adapters import Adapters, load_peft  # noqa: E402

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(model_dir: Path, out: Path, seed: int, r: int) -> Path:
    g, lora = torch.Generator().manual_seed(seed), {}
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        for key in f.keys():
            if key.endswith(tuple(f"{p}.weight" for p in PROJ)):
                out_f, in_f = f.get_slice(key).get_shape()
                name = key.removesuffix(".weight")
                lora[f"base_model.model.{name}.lora_A.weight"] = torch.randn(r, in_f,
                                                                             generator=g) * 0.01
                lora[f"base_model.model.{name}.lora_B.weight"] = torch.randn(out_f, r,
                                                                             generator=g) * 0.01
    out.mkdir(parents=True)
    save_file(lora, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": r, "lora_alpha": r, "target_modules": list(PROJ)}))
    return out


def rate(model, tok, adapters, names, tokens: int) -> float:
    engine = ContinuousBatcher(model, tok.eos_id, max_batch=len(names), adapters=adapters)
    prompt = tok.chat([{"role": "user", "content": "Tell me a long story about a lighthouse."}])
    for i, name in enumerate(names):
        engine.add(str(i), prompt, SamplingParams(max_tokens=tokens, adapter=name))
    return full_batch_rate(engine, len(names))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=str(Path("~/.cache/troupe/smollm2-135m-instruct")
                                          .expanduser()))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quantize", default="none", choices=["none", "w8a8"])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results-multi_lora.jsonl"))
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model_dir = Path(a.model).expanduser()
    tok = load_tokenizer(model_dir)
    base = from_pretrained(model_dir).eval()
    if a.quantize != "none":
        quantize_model(base, {"*": a.quantize})
    adapted = copy.deepcopy(base)
    adapters = Adapters(adapted)
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(4):
            adapters.add(load_peft(write_adapter(model_dir, Path(tmp) / f"a{i}", i, a.rank),
                                   adapted, f"a{i}"))
    mixed = [f"a{i % 4}" for i in range(a.batch)]
    alone, four = [], []
    for _ in range(a.rounds):  # alternating, so that a noisy neighbour hits both alike
        alone.append(rate(base, tok, None, [None] * a.batch, a.tokens))
        four.append(rate(adapted, tok, adapters, mixed, a.tokens))
    line = {"bench": "multi_lora", "machine": machine(), "threads": a.threads,
            "batch": a.batch, "rank": a.rank, "quantize": a.quantize,
            "tokens_per_s_base": statistics.median(alone),
            "tokens_per_s_four_adapters": statistics.median(four),
            "ratio": statistics.median(four) / statistics.median(alone),
            "rounds_base": alone, "rounds_four_adapters": four}
    print(json.dumps(line), flush=True)
    with open(a.out, "a") as f:
        f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
