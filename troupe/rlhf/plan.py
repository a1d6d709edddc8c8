"""What an RLHF recipe will do, planned on the driver before any Ray process starts, so that
a recipe that validates runs.

Every length the recipe sets is held against the model's context (troupe's
``model.gpt.seq_len``, or a Hugging Face directory's config.json): step 3's and the
evaluation's prompts plus ``step3.max_new_tokens``, SFT's demonstrations, the reward model's
and DPO's pairs, ``env.max_tokens`` and ``env.max_turns`` (packed and padded micro-batches
need no check of their own: the model counts each sample's tokens, not the batch's width). A
setting that no example can fit is refused in one line naming both numbers and the key; an
example that alone does not fit (a long prompt in the data) is skipped here, once for every
rank (so ZeRO-3 ranks run the same micro-batches and GRPO/DAPO draw and refill their groups
from what fits), and counted in the run's ``plan`` record of metrics.jsonl. The trained
roles' memory (parameters, gradients, optimizer state: troupe.parallel.memory) is planned from
the model's shapes and held against ``memory_per_worker``. What only the run decides (an
environment that answers at length) ends its trajectory with the ``context`` cause
(troupe.rlhf.agents.loop).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import torch

from troupe.config import ConfigError
from troupe.errors import DataError
from troupe.models import GPT, GPTConfig
from troupe.models.hf_config import context_length, read_config
from troupe.parallel import apply_tensor_parallel
from troupe.parallel.memory import GIB, MemoryPlan, check_budget, size
from troupe.parallel.memory import plan as memory_plan
from troupe.parallel.tensor import Place, check_split, larger_fitting
from troupe.rlhf.config import STEP3, RLHFConfig
from troupe.rlhf.data.datasets import Data, RowView, check_sizes, prepare_data
from troupe.rlhf.models.build import recipe_tokenizer
from troupe.runtime.cluster import check_local_capacity


@dataclass
class Plan:
    """The data the steps will read (what fits the context), the model's context and where
    it is set, how many examples of each kind were skipped as too long, and each trained
    role's memory per rank."""

    data: Data
    context: int
    context_key: str
    skipped: dict[str, int] = field(default_factory=dict)
    memory: dict[str, MemoryPlan] = field(default_factory=dict)

    def record(self) -> dict:
        """The ``plan`` record of metrics.jsonl."""
        return {"kind": "plan", "context": self.context, "skipped": dict(self.skipped),
                "memory_bytes": {role: m.bytes() for role, m in self.memory.items()}}


def architecture(cfg: RLHFConfig) -> tuple[GPTConfig, str]:
    """The model's configuration and the key (or file) its context comes from."""
    if cfg.model.pretrained is None:
        return cfg.model.gpt, "model.gpt.seq_len"
    _, where = context_length(cfg.model.pretrained)
    return read_config(cfg.model.pretrained), where


def plan(cfg: RLHFConfig, steps: Sequence[str], local: bool = False) -> Plan:
    """The plan of running ``steps`` of ``cfg`` (see the module's docstring); ConfigError or
    DataError in one line for what cannot run. ``local`` (the app, about to start Ray; not
    --print-config, whose recipe may be meant for a cluster): the graph's CPUs are also held
    against the local cluster's when the run would start one."""
    arch, key = architecture(cfg)
    splits = [(t, True) for t in sorted(set(cfg.tp_sizes().values()) - {1})]
    if cfg.step3.rollout.tensor_parallel > 1:  # the replicas only infer
        splits.append((cfg.step3.rollout.tensor_parallel, False))
    for t, training in splits if cfg.model.pretrained is not None else ():
        try:
            check_split(arch, t, training)
        except ValueError as e:
            raise ConfigError(f"{e} ({cfg.model.pretrained}/config.json)") from None
    C = arch.seq_len
    where = f"the model's context of {C} tokens ({key})"
    _check_settings(cfg, C, where)
    data = _data(cfg)
    tok = _Lengths(recipe_tokenizer(cfg.model, cfg.env.tools or None))  # the roles' tokenizer's
    out = Plan(data, C, key)
    source = cfg.data.path or "the task"
    if "sft" in steps:
        tok.measure(rows=data.sft)
        out.data.sft = _fitting(out, "demonstrations", data.sft, C,
                                lambda d: tok.prompt_len(d[0]) + tok.text_len(d[1]) + 1,
                                f"sft: no demonstration of {source} fits {where}")
    pairs_needed = ("reward" in steps and cfg.uses_reward_model()) or (
        STEP3 in steps and not cfg.algo().online)
    if pairs_needed:
        tok.measure(rows=[*_listed(data.pairs), *_listed(data.eval_pairs)])

        def pair(p):
            prompt = tok.prompt_len(p[0])
            return prompt + max(tok.text_len(p[1]), tok.text_len(p[2])) + 1
        out.data.pairs = _fitting(out, "pairs", data.pairs, C, pair,
                                  f"no preference pair of {source} fits {where}")
        out.data.eval_pairs = _fitting(out, "eval_pairs", data.eval_pairs, C, pair, None)
    online = STEP3 in steps and cfg.algo().online
    if online or "sft" in steps:  # the held-out evaluation samples as step 3 does
        _prompts(out, tok, cfg, eval_only=not online or bool(cfg.env.function), where=where)
    check_sizes(cfg, out.data, tuple(steps))
    out.memory = _memory(cfg, arch, steps)
    if local:
        _check_cpus(cfg, steps)
    return out


class _Lengths:
    """A tokenizer's ``encode`` and ``prompt`` as lengths, each text measured once: the texts
    a step keeps or skips measured together before it filters them (``measure``, one call of
    the tokenizer), any other (a conversation) when asked."""

    def __init__(self, tok):
        self.tok, self.prompts, self.texts = tok, {}, {}

    def measure(self, rows: list = (), prompts: list = ()) -> None:
        """Measure in one call each the texts not known yet of ``rows`` (a prompt, then
        texts) and ``prompts``; streamed rows (RowView) carry their lengths already."""
        prompts = [*_listed(prompts), *(r[0] for r in _listed(rows))]
        prompts = [p for p in dict.fromkeys(p for p in prompts if isinstance(p, str))
                   if p not in self.prompts]
        texts = [t for t in dict.fromkeys(t for r in _listed(rows) for t in r[1:])
                 if t not in self.texts]
        self.prompts.update(zip(prompts, self.tok.lengths(prompts, prompt=True)))
        self.texts.update(zip(texts, self.tok.lengths(texts)))

    def prompt_len(self, p) -> int:
        if not isinstance(p, str):  # a conversation
            return len(self.tok.prompt(p))
        if p not in self.prompts:
            self.prompts[p] = len(self.tok.prompt(p))
        return self.prompts[p]

    def text_len(self, t: str) -> int:
        if t not in self.texts:
            self.texts[t] = len(self.tok.encode(t))
        return self.texts[t]


def _listed(items) -> list:
    """``items`` unless they are streamed rows (RowView: measured as they were sharded)."""
    return [] if isinstance(items, RowView) else items


def _check_cpus(cfg: RLHFConfig, steps: Sequence[str]) -> None:
    """The graph's CPUs against the local cluster's, when the run would start one."""
    from troupe.rlhf.driver import roles  # the driver builds the graph (and imports this)
    names = roles(cfg)
    actors = sum(map(cfg.tp_of, names))  # each role's tensor-parallel ranks
    cpus = sum(map(cfg.ranks, names)) * cfg.num_cpus
    what = (f"workers={cfg.workers} x {len(names)} roles ({', '.join(names)})"
            + (f" split into {actors} by tensor_parallel" if actors > len(names) else "")
            + f" x num_cpus={cfg.num_cpus:g}")
    r = cfg.step3.rollout
    if r.replicas and STEP3 in steps and cfg.algo().online:
        cpus += cfg.ranks("rollout") * r.num_cpus
        what += (f" and step3.rollout.replicas={r.replicas}"
                 + (f" x tensor_parallel={r.tensor_parallel}" if r.tensor_parallel > 1 else "")
                 + f" x step3.rollout.num_cpus={r.num_cpus:g}")
    check_local_capacity(cpus, what)


def _data(cfg: RLHFConfig) -> Data:
    """``prepare_data``; the bundled task (a function of its settings and the seed) made once
    per process and copied (the plan narrows the copy's lists)."""
    if cfg.data.path:  # a directory of shards: its rows measured by the roles' tokenizer
        return prepare_data(cfg, functools.partial(recipe_tokenizer, cfg.model,
                                                   cfg.env.tools or None))
    key = (cfg.task.model_dump_json(), cfg.seed)
    if key not in _TASKS:
        _TASKS.clear()
        _TASKS[key] = prepare_data(cfg)
    return replace(_TASKS[key])


_TASKS: dict[tuple, Data] = {}


def _check_settings(cfg: RLHFConfig, C: int, where: str) -> None:
    """The lengths the recipe sets that no example could fit."""
    if cfg.env.function:  # the openings come from the environment: no data to hold up
        e, N = cfg.env, cfg.step3.max_new_tokens
        if N >= C:
            raise ConfigError(f"step3.max_new_tokens={N} leaves no room for an opening in "
                              f"{where}: set it below {C}")
        if e.max_tokens >= C:
            raise ConfigError(f"env.max_tokens={e.max_tokens} does not fit {where} after an "
                              f"opening of at least one token: set it below {C}")
        if e.max_turns > e.max_tokens:
            raise ConfigError(f"env.max_turns={e.max_turns} cannot be reached within "
                              f"env.max_tokens={e.max_tokens} (each assistant turn takes a "
                              "token at least)")


def _prompts(out: Plan, tok, cfg: RLHFConfig, eval_only: bool, where: str) -> None:
    """Step 3's and the evaluation's prompts that leave room for step3.max_new_tokens."""
    N = cfg.step3.max_new_tokens
    budget = out.context - N
    length = tok.prompt_len
    d = out.data
    source = cfg.data.path or "the task"

    def narrow(prompts: list, fields: list | None, which: str, kind: str):
        """The prompts (and their rows' fields) that fit; DataError when none does."""
        if isinstance(prompts, RowView):  # streamed rows: their lengths measured already
            fits = prompts.lengths <= budget
            if not fits.any():
                raise DataError(f"step3.max_new_tokens={N} plus the shortest {which} of "
                                f"{source} ({int(prompts.lengths.min())} tokens) exceed "
                                f"{where}: at most "
                                f"{max(out.context - int(prompts.lengths.min()), 0)} new "
                                "tokens fit")
            out.skipped[kind] = int((~fits).sum())
            return prompts.keep(fits), fields.keep(fits) if fields is not None else None
        keep = _kept(prompts, budget, length)
        if not keep:
            shortest = min(map(length, prompts))
            raise DataError(f"step3.max_new_tokens={N} plus the shortest {which} of {source} "
                            f"({shortest} tokens) exceed {where}: at most "
                            f"{max(out.context - shortest, 0)} new tokens fit")
        out.skipped[kind] = len(prompts) - len(keep)
        return [prompts[i] for i in keep], [fields[i] for i in keep] if fields else fields

    tok.measure(prompts=[*([] if eval_only else _listed(d.prompts)), *_listed(d.eval_prompts)])
    if not eval_only:
        d.prompts, d.fields = narrow(d.prompts, d.fields, "prompt", "prompts")
    d.eval_prompts, d.eval_fields = narrow(d.eval_prompts, d.eval_fields, "held-out prompt",
                                           "eval_prompts")


def _kept(items: list, budget: int, length: Callable) -> list[int]:
    return [i for i, x in enumerate(items) if length(x) <= budget]


def _fitting(out: Plan, kind: str, items: list, C: int, length: Callable,
             none_fit: str | None) -> list:
    """The items of at most ``C`` tokens; the others counted under ``kind``; DataError
    ``none_fit`` (with the shortest's length) when none is left."""
    if isinstance(items, RowView):  # streamed rows: their lengths measured already
        fits = items.lengths <= C
        if not fits.any() and len(items) and none_fit is not None:
            raise DataError(f"{none_fit}: the shortest has {int(items.lengths.min())} tokens")
        out.skipped[kind] = int((~fits).sum())
        return items.keep(fits)
    keep = _kept(items, C, length)
    if not keep and items and none_fit is not None:
        raise DataError(f"{none_fit}: the shortest has {min(map(length, items))} tokens")
    out.skipped[kind] = len(items) - len(keep)
    return [items[i] for i in keep]


def _memory(cfg: RLHFConfig, arch: GPTConfig, steps: Sequence[str]) -> dict[str, MemoryPlan]:
    """Each trained role's memory per rank, from the model's shapes; MemoryBudgetError (a
    ConfigError) naming the role when ``memory_per_worker`` is set and a plan exceeds it."""
    optimizers = {}
    if "sft" in steps:
        optimizers["policy (sft)"] = cfg.sft.optimizer
    if "reward" in steps and cfg.uses_reward_model():
        optimizers["reward"] = cfg.reward.optimizer
    if STEP3 in steps and not cfg.algo().online:
        optimizers["policy (dpo)"] = cfg.dpo.optimizer
    elif STEP3 in steps:
        optimizers["policy"] = cfg.step3.actor
        if cfg.uses_critic():
            optimizers["critic"] = cfg.step3.critic
    budget = cfg.memory_per_worker

    @functools.cache
    def shapes(t: int) -> GPT:  # tensor-parallel rank 0's shards (it holds the most)
        with torch.device("meta"):
            return apply_tensor_parallel(GPT(arch), Place(0, t) if t > 1 else None)

    def planned(opt, t: int, stage: int) -> MemoryPlan:
        return memory_plan(shapes(t), opt, cfg.workers, stage, cfg.zero_prefetch, tp=t)
    plans = {}
    for role, opt in optimizers.items():
        T = cfg.tp_of(role.split()[0])  # "policy (sft)": the policy's
        mine = planned(opt, T, cfg.zero_stage)
        who = f"role {role!r}"
        if budget is not None and mine.total > budget * GIB:
            larger = larger_fitting(arch, T, lambda t: planned(opt, t, 1).total, budget * GIB)
            if larger:
                who += (f" (tensor_parallel={larger} would plan "
                        f"{size(planned(opt, larger, 1).total)} a rank at zero_stage 1)")
        check_budget(mine, budget, who, planned(opt, T, 4 - cfg.zero_stage))
        plans[role] = mine
    return plans

