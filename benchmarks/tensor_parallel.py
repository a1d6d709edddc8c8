"""Tensor parallelism (troupe.parallel.tensor) measured, one JSON line per figure:

    python benchmarks/tensor_parallel.py [--parts maths ted steps budget]

maths: a GPT (width 512, 4 blocks, byte vocabulary) on T = 1, 2, 4 ranks (threads of this
    process with gloo groups, troupe.collectives.threads): each rank's parameter bytes
    against P / T for the split layers (the goal: at most 1.02 x), the activation bytes a
    rank keeps for the backward (every tensor autograd saves, counted by a saved-tensors
    hook: exact, where a resident-memory peak on the CPU is mostly the process), the bytes
    the tensor-parallel group all-reduces and gathers a step (forward and backward), and
    the loss against one rank's.
ted: an MoE GPT on tp=2 x ep=2 (4 ranks): the expert-parallel all-to-all bytes of a forward
    and backward with TED's duplicate-token dropping and without (each tp rank dispatching
    every token), the outputs of both against one rank's (the goal: with <= 1/T of without,
    equal outputs).
steps: pretraining steps of the same GPT in Ray actors (apps' driver): T = 1 (one trainer of
    2 threads) against T = 2 (two trainers of 1 thread: the same cores), the median step
    time and each one's peak resident memory.
budget: a GPT of about 100M parameters under memory_per_worker: refused at T = 1 before any
    process starts (the refusal names the size that fits), trained at T = 2 for 3 steps,
    each rank's measured peak (VmHWM, the whole process) against the budget.
equality: pretraining of the dense and MoE GPTs of the suite's shapes, 30 steps at T = 1 and
    T = 2 (MoE: each step's routing the same, as the losses show), the largest relative
    difference of the losses and whether they are bit for bit.
smollm2: SmolLM2-135M-Instruct (9 query, 3 key/value heads) at T = 3 against T = 1: greedy
    decoding of 64 tokens (fp32, the engine's native step per shard; ranks as threads) and
    its rate; the perplexity of W8A8 on held-out text (the standard library's held-out
    docstrings), each rank calibrating and quantizing its own shards as a served rank does
    (troupe.serving.ranks), against T = 1's; continued pretraining, 10 steps at T = 3
    against T = 1 (the steps of RLHF's SFT are the same loss on other data).
rlhf: RLHF's policy role (troupe.rlhf.roles.policy.Policy) of SmolLM2 at T = 3 against
    T = 1 (ranks as threads): greedy rollouts of up to 64 tokens through the role's own engine
    (tokens identical or not) and their log-probabilities, before and after SFT on the
    bundled task's demonstrations (the losses' relative difference at each step, bit for bit
    or not).
served: SmolLM2 behind the OpenAI server at T = 1 and 3, fp32 and W8A8 (see ``served``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from machine import machine  # noqa: E402  benchmarks/machine.py, beside this script
from troupe.collectives.threads import run_groups, run_ranks  # noqa: E402
from troupe.config import ConfigError  # noqa: E402
from troupe.models import GPT, GPTConfig  # noqa: E402
from troupe.models.moe import MoE  # noqa: E402
from troupe.parallel import apply_expert_parallel, apply_tensor_parallel  # noqa: E402
from troupe.parallel.layout import ParallelLayout  # noqa: E402
from troupe.parallel.tensor import layout  # noqa: E402

GPT_512 = dict(vocab_size=257, seq_len=128, n_layer=4, n_head=8, d_model=512)
GPT_100M = dict(vocab_size=257, seq_len=64, n_layer=8, n_head=16, d_model=1024)


def emit(line: dict) -> None:
    print(json.dumps({"bench": "tensor_parallel", "machine": machine(), **line}), flush=True)


class Counted:
    """A communicator that counts the bytes its all-reduces and all-gathers carry."""

    def __init__(self, group):
        self.group, self.bytes = group, 0
        self.rank, self.world_size = group.rank, group.world_size

    def all_reduce(self, x, op="sum"):
        self.bytes += x.numel() * x.element_size()
        return self.group.all_reduce(x, op)

    def all_gather(self, x, out=None):
        self.bytes += x.numel() * x.element_size()
        return self.group.all_gather(x, out)


def _saved_bytes(fn) -> tuple[object, int]:
    """``fn()`` and the bytes of every tensor autograd saved for its backward (each storage
    once)."""
    seen: dict[int, int] = {}

    def pack(t):
        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def maths(a) -> None:
    cfg = GPTConfig(**GPT_512)
    B = 4
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (B, cfg.seq_len), generator=g)
    y = torch.randint(0, cfg.vocab_size, (B, cfg.seq_len), generator=g)
    whole = GPT(cfg, seed=1)
    P = sum(p.numel() for p in whole.parameters())
    names = set(layout(whole, 2))  # the parameters tensor parallelism splits
    split_whole = 4 * sum(p.numel() for n, p in whole.named_parameters() if n in names)
    reference = None
    for T in (1, 2, 4):
        def rank(group):
            torch.set_num_threads(1)
            counted = Counted(group) if group is not None else None
            model = apply_tensor_parallel(GPT(cfg, seed=1), counted)
            split = sum(p.numel() for n, p in model.named_parameters() if n in names)
            params = sum(p.numel() for p in model.parameters())
            t0 = time.perf_counter()
            (_, loss, _), saved = _saved_bytes(lambda: model(x, y))
            loss.backward()
            seconds = time.perf_counter() - t0
            return (loss.item(), params * 4, split * 4, saved, counted.bytes if counted else 0,
                    seconds)
        out = [rank(None)] if T == 1 else run_ranks(T, rank)
        if T == 1:
            reference = out[0]
        emit({"part": "maths", "T": T, "params": P, "tokens": B * cfg.seq_len,
              "param_bytes_per_rank": max(o[1] for o in out),
              "split_param_bytes_per_rank": max(o[2] for o in out),
              "split_over_ideal": round(max(o[2] for o in out) / (split_whole / T), 4),
              "replicated_param_bytes": out[0][1] - out[0][2],
              "saved_activation_bytes_per_rank": max(o[3] for o in out),
              "activations_over_T1": round(max(o[3] for o in out) / reference[3], 3),
              "tp_collective_bytes_per_step": out[0][4],
              "loss": out[0][0], "loss_T1": reference[0],
              "rel_diff": abs(out[0][0] - reference[0]) / reference[0]})


def ted(a) -> None:
    cfg = GPTConfig(**{**GPT_512, "n_layer": 2, "seq_len": 64,
                       "moe": dict(num_experts=4, expert_interval=1, top_k=2,
                                   capacity_factor=1.25)})
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len), generator=g)
    y = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len), generator=g)
    with torch.no_grad():
        whole = GPT(cfg, seed=1)(x)[0]
    grid = ParallelLayout.of(4, tp=2, ep=2)

    def rank(groups, r, drop):
        torch.set_num_threads(1)
        model = apply_expert_parallel(apply_tensor_parallel(GPT(cfg, seed=1), groups["tp"]),
                                      groups["ep"])
        moes = [m for m in model.modules() if isinstance(m, MoE)]
        for m in moes:
            m.drop_duplicates = drop
        _, loss, aux = model(x, y)
        (loss + 0.01 * aux).backward()
        with torch.no_grad():
            logits = model(x)[0]
        return sum(m.meter.bytes for m in moes), (logits - whole).abs().max().item()
    results = {drop: run_groups(grid.world, grid.groups(), rank, drop) for drop in (True, False)}
    sent = {drop: sum(b for b, _ in out) for drop, out in results.items()}
    emit({"part": "ted", "tp": 2, "ep": 2, "tokens": x.numel(),
          "a2a_bytes_with_dropping": sent[True], "a2a_bytes_without": sent[False],
          "with_over_without": round(sent[True] / sent[False], 4),
          "max_logit_diff_with": max(d for _, d in results[True]),
          "max_logit_diff_without": max(d for _, d in results[False])})


def _pretrain_cfg(model: dict, workers: int, T: int, threads: int, steps: int,
                  budget: float | None = None):
    from troupe.pretrain.config import PretrainConfig
    return PretrainConfig(
        model=model, optimizer=dict(name="adamw", lr=3e-4, warmup_steps=0),
        train=dict(steps=steps, batch_size=4, eval_every=0, checkpoint_every=0,
                   placement_timeout_s=120),
        data=dict(max_chars=400_000), workers=workers, tensor_parallel=T, threads=threads,
        device="cpu", memory_per_worker=budget, out_dir=f"/tmp/troupe-tp-bench/{T}")


def _train(cfg, steps: int) -> dict:
    from troupe.pretrain import driver as pretrain
    from troupe.pretrain.topology import TRAINER
    from troupe.pretrain.workers import TrainerActor
    built = pretrain.build_graph(cfg, name=f"tp-{cfg.tensor_parallel}")
    try:
        times, losses, peaks = [], [], []
        for step in range(1, steps + 1):
            stats = built.graph[TRAINER].invoke(TrainerActor.train_step, step)
            if step > 1:
                times.append(max(s.seconds for s in stats))
            losses.append(round(stats[0].loss, 4))
            peaks = [max(p, s.peak_memory_mb) for p, s in
                     zip(peaks or [0.0] * len(stats), stats)]
        info = built.trainers
    finally:
        built.shutdown()
    return {"step_s": round(statistics.median(times), 3), "losses": losses,
            "peak_rss_mb_per_rank": [round(p) for p in peaks],
            "persistent_bytes_per_rank": [i.param_bytes + i.grad_bytes + i.optimizer_bytes
                                          for i in info]}


def steps(a) -> None:
    out = {}
    for T, threads in ((1, 2), (2, 1)):
        out[T] = _train(_pretrain_cfg(GPT_512, T, T, threads, a.steps), a.steps)
        emit({"part": "steps", "T": T, "threads_per_rank": threads, **out[T]})
    emit({"part": "steps", "step_time_T2_over_T1": round(out[2]["step_s"] / out[1]["step_s"], 3)})


def budget(a) -> None:
    from troupe.pretrain.plan import plan
    line = {"part": "budget", "memory_per_worker_gib": a.memory_per_worker,
            "params": sum(p.numel() for p in GPT(GPTConfig(**GPT_100M)).parameters())}
    try:
        plan(_pretrain_cfg(GPT_100M, 1, 1, 1, 3, a.memory_per_worker))
        line["T1"] = "planned within the budget (raise the model or lower the budget)"
    except ConfigError as e:
        line["T1_refused"] = str(e)
    cfg = _pretrain_cfg(GPT_100M, 2, 2, 1, 3, a.memory_per_worker)
    line["T2_planned_bytes"] = plan(cfg).total
    got = _train(cfg, 3)
    line.update({f"T2_{k}": v for k, v in got.items()})
    line["T2_peak_within_budget"] = all(p <= a.memory_per_worker * 1024
                                        for p in got["peak_rss_mb_per_rank"])
    emit(line)
    # the same model trained through the app's driver (exported as a Hugging Face
    # directory), then served at T = 2 against transformers' greedy tokens
    from troupe.pretrain import driver as pretrain
    records = pretrain.run(cfg, resume=None, progress=False)
    peak = max(r["peak_memory_mb"] for r in records if r["kind"] == "train")
    emit({"part": "budget", "check": "served_T2_vs_transformers",
          **served_against_transformers(Path(cfg.out_dir) / "hf", 2, 32),
          "trained_peak_rss_mb": round(peak), "within_budget": peak <= a.memory_per_worker * 1024})


def served_against_transformers(hf_dir: Path, T: int, n: int) -> dict:
    """The greedy tokens of ``hf_dir`` served over T tensor-parallel ranks (fp32) against
    transformers' ``generate`` on the same directory, for ``n`` tokens."""
    import openai
    from transformers import AutoModelForCausalLM
    from troupe.serving import deploy as serve
    from troupe.serving.config import ServeConfig
    prompt = "The shard was read by every rank"
    ids = list(prompt.encode())  # the byte tokenizer's ids
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    cfg = ServeConfig(model={"pretrained": str(hf_dir), "name": "m"}, quantize={},
                      tensor_parallel=T, num_cpus=0.5, api_key_env="TROUPE_BENCH_NO_KEY",
                      port=8124)
    url = serve.deploy(cfg)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", timeout=600)
        out = client.completions.create(model="m", prompt=ids, max_tokens=n, temperature=0,
                                        extra_body={"ignore_eos": True,
                                                    "return_token_ids": True})
        got = out.choices[0].model_extra.get("token_ids")
    finally:
        serve.shutdown()
    return {"T": T, "tokens": n, "identical": got == want, "served": got[:8], "hf": want[:8]}


def equality(a) -> None:
    from troupe.pretrain import driver as pretrain
    from troupe.pretrain.config import PretrainConfig
    moe = dict(num_experts=4, expert_interval=1, capacity_factor=1.0, min_capacity=2)
    for name, extra in (("dense", {}), ("moe", {"moe": moe})):
        losses = {}
        for T in (1, 2):
            cfg = PretrainConfig(
                model=dict(seq_len=32, n_layer=2, n_head=4, d_model=32, **extra),
                optimizer=dict(name="adamw", lr=3e-3, warmup_steps=2),
                data=dict(max_chars=200_000), workers=T, tensor_parallel=T,
                train=dict(steps=30, batch_size=4, eval_every=0, checkpoint_every=0),
                out_dir=f"/tmp/troupe-tp-bench/eq-{name}-{T}")
            records = pretrain.run(cfg, resume=None, progress=False)
            losses[T] = [r["loss"] for r in records if r["kind"] == "train"]
        rel = max(abs(x - y) / y for x, y in zip(losses[2], losses[1]))
        emit({"part": "equality", "model": name, "steps": 30, "max_rel_diff": rel,
              "bit_for_bit": losses[1] == losses[2], "first_loss": losses[1][0],
              "last_loss": losses[1][-1]})


def smollm2(a) -> None:
    import math
    from troupe.data import DataConfig, TokenDataset, load_tokenizer
    from troupe.generation import ContinuousBatcher, SamplingParams
    from troupe.models import from_pretrained
    from troupe.models import smollm2 as pkg
    from troupe.parallel.tensor import bias_on_first_rank
    from troupe.serving.config import ServeConfig
    from troupe.serving.model import calibrate, quantize_served, source_tokenizer
    path = str(pkg.build())
    tok = load_tokenizer(path)
    prompts = [tok.encode("The capital of France is"),
               tok.encode("def fibonacci(n):\n    ")]

    def greedy(model):
        engine = ContinuousBatcher(model, eos_id=tok.eos_id, max_batch=4)
        for i, p in enumerate(prompts):
            engine.add(str(i), p, SamplingParams(max_tokens=64, temperature=0.0,
                                                 ignore_eos=True))
        t0 = time.perf_counter()
        out = engine.run()
        return out, time.perf_counter() - t0, engine.fused is not None

    torch.set_num_threads(2)
    one, one_s, one_fused = greedy(from_pretrained(path))

    def rank(group):
        torch.set_num_threads(1)
        return greedy(apply_tensor_parallel(from_pretrained(path), group, training=False))
    three = run_ranks(3, rank)
    tokens = sum(len(t) for t in one.values())
    emit({"part": "smollm2", "check": "greedy_fp32", "T": 3, "tokens": tokens,
          "identical": all(o[0] == one for o in three), "native_step": [one_fused, three[0][2]],
          "T1_tokens_per_s": round(tokens / one_s, 1),
          "T3_tokens_per_s_threads": round(tokens / max(o[1] for o in three), 1)})

    serve = ServeConfig(model={"pretrained": path}, quantize={"*": "w8a8"})
    data = TokenDataset(DataConfig(), tok)

    @torch.no_grad()
    def perplexity(model) -> float:
        losses = [model(x, y)[1].item() for x, y in data.val_batches(4, 4, 256)]
        return math.exp(sum(losses) / len(losses))

    torch.set_num_threads(2)
    whole = from_pretrained(path)
    quantize_served(whole, serve, calibrate(whole, serve, source_tokenizer(serve.model)))
    ppl_one = perplexity(whole)

    def quantized_rank(group):
        torch.set_num_threads(1)
        model = apply_tensor_parallel(from_pretrained(path), group, training=False)
        quantize_served(model, serve, calibrate(model, serve, source_tokenizer(serve.model)))
        bias_on_first_rank(model)
        return perplexity(model)
    ppl_three = run_ranks(3, quantized_rank)
    emit({"part": "smollm2", "check": "w8a8_perplexity", "T": 3, "ppl_T1": ppl_one,
          "ppl_T3": ppl_three[0], "rel_diff": abs(ppl_three[0] - ppl_one) / ppl_one,
          "goal": 0.002})

    from troupe.pretrain import driver as pretrain
    from troupe.pretrain.config import PretrainConfig
    losses = {}
    for T in (1, 3):
        cfg = PretrainConfig(
            model=dict(pretrained=path, seq_len=64),
            optimizer=dict(name="adamw", lr=1e-5, warmup_steps=0), device="cpu",
            data=dict(max_chars=200_000), workers=T, tensor_parallel=T,
            train=dict(steps=10, batch_size=2, eval_every=0, checkpoint_every=0),
            out_dir=f"/tmp/troupe-tp-bench/smollm2-{T}")
        t0 = time.perf_counter()
        records = pretrain.run(cfg, resume=None, progress=False, export=lambda c, o: None)
        losses[T] = ([r["loss"] for r in records if r["kind"] == "train"],
                     time.perf_counter() - t0)
    rel = max(abs(x - y) / y for x, y in zip(losses[3][0], losses[1][0]))
    emit({"part": "smollm2", "check": "continued_pretraining", "T": 3, "steps": 10,
          "max_rel_diff": rel, "bit_for_bit": losses[1][0] == losses[3][0],
          "losses_T1": [round(x, 4) for x in losses[1][0]],
          "seconds": {1: round(losses[1][1], 1), 3: round(losses[3][1], 1)}})


def rlhf(a) -> None:
    from troupe.models import smollm2 as pkg
    from troupe.rlhf.config import RLHFConfig
    from troupe.rlhf.data.datasets import SortTask
    from troupe.rlhf.data.experience import RolloutRequest
    from troupe.rlhf.roles.policy import Policy
    path = str(pkg.build())
    steps, batch = a.steps, 4
    demos = SortTask().demonstrations(steps * batch, 0)
    prompts = ["sort 8302:", "Write a haiku about autumn.", "What is 17 + 25?"]

    def run(tp):
        T = 1 if tp is None else tp.world_size
        torch.set_num_threads(2 if tp is None else 1)
        cfg = RLHFConfig(model=dict(pretrained=path), workers=1, tensor_parallel=T,
                         sft=dict(steps=steps, batch_size=batch,
                                  optimizer=dict(name="adamw", lr=1e-5, warmup_steps=0)),
                         step3=dict(max_new_tokens=64, temperature=0.0))
        pol = Policy(cfg, None, 0 if tp is None else tp.rank, tp)
        request = RolloutRequest(prompts, list(range(len(prompts))))
        t0 = time.perf_counter()
        before = pol.generate(request)  # the pretrained model: long answers
        gen_s = time.perf_counter() - t0
        before_logp = pol.logprobs(before.ids, before.valid, before.action, before.prompt_len)
        pol.train.use_optimizer(cfg.sft.optimizer, steps)
        t0 = time.perf_counter()
        losses = [pol.sft_step(demos[batch * s:batch * (s + 1)], s + 1).loss
                  for s in range(steps)]
        sft_s = time.perf_counter() - t0
        after = pol.generate(request)
        after_logp = pol.logprobs(after.ids, after.valid, after.action, after.prompt_len)
        return (losses, before, before_logp, after, after_logp, sft_s, gen_s)

    one = run(None)
    three = run_ranks(3, run)[0]
    rel = [abs(x - y) / y for x, y in zip(three[0], one[0])]
    emit({"part": "rlhf", "check": "sft_and_greedy", "T": 3, "model": "SmolLM2-135M-Instruct",
          "sft_steps": steps, "max_rel_diff": max(rel), "rel_diff_by_step": rel,
          "bit_for_bit": three[0] == one[0], "losses_T1": [round(x, 4) for x in one[0]],
          "greedy_tokens_before_sft": int(one[1].action.sum()),
          "greedy_identical_before_sft": three[1].ids.tolist() == one[1].ids.tolist(),
          "logprob_max_abs_diff_before_sft": float((three[2] - one[2]).abs().max()),
          "greedy_tokens_after_sft": int(one[3].action.sum()),
          "greedy_identical_after_sft": three[3].ids.tolist() == one[3].ids.tolist(),
          "logprob_max_abs_diff_after_sft": float((three[4] - one[4]).abs().max()),
          "sft_s": {1: round(one[5], 1), 3: round(three[5], 1)},
          "generate_s_before_sft": {1: round(one[6], 1), 3: round(three[6], 1)}})


def served(a) -> None:
    """SmolLM2 behind apps/serve.py's server at T = 1 and T = 3 (fp32 and W8A8): the rate of
    one request of 64 greedy tokens (after one to warm up), and whether T = 3's text is
    T = 1's (fp32: it must be; W8A8: each rank's own scales, so it may part)."""
    import openai
    from troupe.models import smollm2 as pkg
    from troupe.serving import deploy as serve
    from troupe.serving.config import ServeConfig
    path = str(pkg.build())
    prompt = "Write a short story about a lighthouse keeper."
    texts = {}
    for quantize in ({}, {"*": "w8a8"}):
        for T in (1, 3):
            cfg = ServeConfig(model={"pretrained": path, "name": "m"}, quantize=quantize,
                              tensor_parallel=T, num_cpus=0.5, threads=1 if T > 1 else 2,
                              api_key_env="TROUPE_BENCH_NO_KEY", port=8123)
            url = serve.deploy(cfg)
            try:
                client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", timeout=600)

                def ask():
                    out = client.completions.create(model="m", prompt=prompt, max_tokens=64,
                                                    temperature=0, extra_body={"ignore_eos": True})
                    return out.choices[0].text
                ask()
                t0 = time.perf_counter()
                text = ask()
                seconds = time.perf_counter() - t0
            finally:
                serve.shutdown()
            mode = "w8a8" if quantize else "fp32"
            texts[mode, T] = text
            emit({"part": "served", "model": "smollm2", "mode": mode, "T": T,
                  "threads_per_rank": cfg.threads, "tokens_per_s": round(64 / seconds, 1),
                  "same_text_as_T1": text == texts[mode, 1]})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--parts", nargs="*",
                   default=["maths", "ted", "steps", "budget", "equality", "smollm2",
                            "rlhf", "served"])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--memory-per-worker", type=float, default=1.4)
    a = p.parse_args()
    if {"steps", "budget", "equality", "smollm2", "served"} & set(a.parts):
        import troupe
        troupe.init(num_cpus=4)
    for part in a.parts:
        globals()[part](a)


if __name__ == "__main__":
    main()
