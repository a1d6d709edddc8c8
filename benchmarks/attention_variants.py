"""Greedy decoding of the attention variants through troupe's engine, with the native decode
step and with the model's own (Python) step, against transformers' generate on the same
weights, in one run.

    python benchmarks/attention_variants.py [--threads 2] [--new-tokens 64] [--repeats 3]
                                            [--batch 1 8] [--variants NAME ...]

Each variant is a random model of one shape (6 layers, width 512, 8 query heads of 64 and 2
key/value heads, SwiGLU of 1536, vocabulary 8192, fp32) in one Hugging Face family: Llama (the
reference), Qwen3 (q and k normalised per head), Qwen2 with YaRN, Mistral with heads of 128
over the width of 512 (Mistral-Nemo's layout) and Mistral with a sliding window of 32 (shorter
than prompt plus new tokens). Each engine is built, and each path run once, before the timed
runs. All three paths must choose the same tokens. One JSON line per variant and batch size:
new tokens per second of each path (median of the repeats) and the native step's ratio to the
Python step and to transformers.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch
import transformers

from troupe.generation import ContinuousBatcher, SamplingParams
from troupe.models import from_pretrained
from hf_models import timed  # benchmarks/hf_models.py, beside this script
from machine import machine

SHAPE = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)
VARIANTS = {
    "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig, {}),
    "qwen3-qk-norm": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config, dict(head_dim=64)),
    "qwen2-yarn": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config, dict(
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128})),
    "mistral-head-dim-128": (transformers.MistralForCausalLM, transformers.MistralConfig,
                             dict(head_dim=128, sliding_window=None)),
    "mistral-sliding-32": (transformers.MistralForCausalLM, transformers.MistralConfig,
                           dict(sliding_window=32)),
}


def engine_for(model, batch: int, native: bool) -> ContinuousBatcher:
    """The engine, built (and the weights packed for decoding) before any timing."""
    engine = ContinuousBatcher(model, None, max_batch=batch)
    if not native:
        engine.fused = None
    return engine


def ours(engine, prompts: list[list[int]], new: int) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add(str(i), p, SamplingParams(max_tokens=new))
    out = engine.run()
    return [out[str(i)] for i in range(len(prompts))]


@torch.inference_mode()
def theirs(model, prompts: list[list[int]], new: int) -> list[list[int]]:
    ids = torch.tensor(prompts)  # prompts of one length: no padding
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                         min_new_tokens=new, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    for name in a.variants:
        cls, config, extra = VARIANTS[name]
        torch.manual_seed(0)
        reference = cls(config(**SHAPE, **extra)).eval()
        reference.generation_config.eos_token_id = None
        with tempfile.TemporaryDirectory() as d:
            reference.save_pretrained(d)
            model = from_pretrained(d).eval()
        for batch in a.batch:
            prompts = torch.randint(0, SHAPE["vocab_size"], (batch, a.prompt_tokens),
                                    generator=g).tolist()
            fused, plain = engine_for(model, batch, True), engine_for(model, batch, False)
            assert fused.fused is not None, f"{name}: the native step does not apply"
            for run in (lambda: ours(fused, prompts, a.new_tokens),  # warm: kernels chosen
                        lambda: ours(plain, prompts, a.new_tokens),
                        lambda: theirs(reference, prompts, a.new_tokens)):
                run()
            t_native, native = timed(lambda: ours(fused, prompts, a.new_tokens), a.repeats)
            t_python, python = timed(lambda: ours(plain, prompts, a.new_tokens), a.repeats)
            t_hf, hf = timed(lambda: theirs(reference, prompts, a.new_tokens), a.repeats)
            tokens = batch * a.new_tokens
            print(json.dumps({
                "bench": "attention_variants", "machine": machine(), "threads": a.threads,
                "variant": name, "batch": batch, "new_tokens": a.new_tokens,
                "native_tok_s": round(tokens / t_native, 1),
                "python_step_tok_s": round(tokens / t_python, 1),
                "transformers_tok_s": round(tokens / t_hf, 1),
                "native_vs_python_step": round(t_python / t_native, 2),
                "native_vs_transformers": round(t_hf / t_native, 2),
                "same_tokens": native == python == hf}), flush=True)


if __name__ == "__main__":
    main()
