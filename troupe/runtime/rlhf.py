"""Driver of the three-step RLHF pipeline: one graph holding the policy, reference, reward and
critic roles (colocated on the same bundles by default), and the loops of SFT, reward-model
training and PPO. Metrics go to JSON lines, plots to rlhf.png, weights after each step and
every ``ppo.checkpoint_every`` PPO iterations."""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from troupe.actors import CriticActor, PolicyActor, ReferenceActor, RewardActor
from troupe.errors import WorkerCallError, WorkerDiedError
from troupe.rlhf import ppo
from troupe.rlhf.config import RLHFConfig
from troupe.rlhf.data import SortTask, read_jsonl
from troupe.runtime import checkpoint
from troupe.runtime.graph import ActorGraph, rewire
from troupe.runtime.handle import Graph
from troupe.runtime.metrics import MetricsLog
from troupe.training.checkpoint import read_manifest

STEPS = ("sft", "reward", "ppo")
logger = logging.getLogger(__name__)


@dataclass
class Data:
    sft: list[tuple[str, str]]
    pairs: list[tuple[str, str, str]]
    eval_pairs: list[tuple[str, str, str]]
    prompts: list[str]
    eval_prompts: list[str]
    gold: Callable[[str, str], float] | None


def prepare_data(cfg: RLHFConfig) -> Data:
    """The bundled task (generated from the seed) or the JSON-lines file of ``data.path``."""
    if cfg.data.path:
        rows = read_jsonl(cfg.data.path)
        n_eval = max(1, int(len(rows) * cfg.data.eval_fraction))
        train, held = rows[:-n_eval], rows[-n_eval:]
        return Data([(e.prompt, e.chosen) for e in train],
                    [(e.prompt, e.chosen, e.rejected) for e in train],
                    [(e.prompt, e.chosen, e.rejected) for e in held],
                    [e.prompt for e in train], [e.prompt for e in held], None)
    t, s = cfg.task, cfg.seed
    task = SortTask(t.min_digits, t.max_digits, t.noise)
    pairs = [(e.prompt, e.chosen, e.rejected) for e in task.preferences(
        t.preference_examples + t.eval_examples, s + 2)]
    return Data(task.demonstrations(t.sft_examples, s + 1), pairs[:-t.eval_examples],
                pairs[-t.eval_examples:], task.prompts(20000, s + 3),
                task.prompts(t.eval_examples, s + 4), task.gold)


def build_graph(cfg: RLHFConfig, timeout_s: float = 300.0) -> Graph:
    """The four roles, ``cfg.workers`` each; colocated on the policy's bundles unless
    ``cfg.colocate`` is off; data-parallel groups for the roles that train."""
    g, W, conf = ActorGraph("rlhf"), cfg.workers, cfg.model_dump()
    g.role("policy", PolicyActor, W, num_cpus=cfg.num_cpus, config=conf,
           max_restarts=cfg.max_restarts)
    for name, cls in (("reference", ReferenceActor), ("reward", RewardActor),
                      ("critic", CriticActor)):
        g.role(name, cls, W, num_cpus=cfg.num_cpus, config=conf,
               colocate_with="policy" if cfg.colocate else None,
               max_restarts=cfg.max_restarts)
    if W > 1:
        for name in ("policy", "reward", "critic"):
            g.collective(name, [name])
    graph = g.build(timeout_s=timeout_s, call_timeout_s=900)
    try:
        for name in ("policy", "reference", "reward", "critic"):
            graph[name].call("setup")
    except BaseException:
        graph.shutdown()
        raise
    return graph


def _batches(items: list, batch: int, steps: int, seed: int):
    rng = random.Random(seed)
    for step in range(1, steps + 1):
        yield step, rng.sample(items, batch)


def run_sft(graph: Graph, cfg: RLHFConfig, data: Data, log: MetricsLog, out: Path) -> Path:
    policy, c = graph["policy"], cfg.sft
    policy.call("start_sft", c.steps)
    for step, batch in tqdm(_batches(data.sft, c.batch_size, c.steps, cfg.seed + 10),
                            total=c.steps, desc="step 1: SFT"):
        stats = policy.scatter("sft_step", batch, step)
        log.write({"kind": "sft", "step": step, "loss": _mean(stats, "loss")})
    path = out / "sft" / "policy.trp"
    policy.call_rank(0, "save", str(path))
    return path


def run_reward(graph: Graph, cfg: RLHFConfig, data: Data, log: MetricsLog, out: Path) -> Path:
    reward, c = graph["reward"], cfg.reward
    sft = out / "sft" / "policy.trp"
    if c.init_from_sft and not sft.is_file():
        raise FileNotFoundError(f"reward.init_from_sft: {sft} does not exist; run step 1 first "
                                "or set reward.init_from_sft=false")
    reward.call("start_training", c.steps, str(sft) if c.init_from_sft else None)
    for step, batch in tqdm(_batches(data.pairs, c.batch_size, c.steps, cfg.seed + 20),
                            total=c.steps, desc="step 2: reward model"):
        stats = reward.scatter("rm_step", batch, step)
        log.write({"kind": "reward", "step": step, "loss": _mean(stats, "loss"),
                   "accuracy": _mean(stats, "accuracy")})
    ev = reward.scatter("evaluate", data.eval_pairs)
    acc = sum(e["correct"] for e in ev) / sum(e["count"] for e in ev)
    log.write({"kind": "reward_eval", "step": c.steps, "accuracy": acc,
               "loss": _mean(ev, "loss")})
    path = out / "reward" / "reward.trp"
    reward.call_rank(0, "save", str(path))
    return path


def evaluate_policy(graph: Graph, data: Data, seed: int, temperature: float | None = None,
                    use_ema: bool = False) -> dict:
    """Gold reward (if the task has one) of the policy's responses to the held-out prompts."""
    gens = graph["policy"].scatter("generate", data.eval_prompts, seed, use_ema, temperature)
    responses = [r for g in gens for r in g["responses"]]
    out = {"samples": list(zip(data.eval_prompts[:4], responses[:4]))}
    if data.gold is not None:
        gold = [data.gold(p, r) for p, r in zip(data.eval_prompts, responses)]
        out["gold"] = sum(gold) / len(gold)
        out["exact"] = sum(g == 1.0 for g in gold) / len(gold)
    return out


def make_experience(graph: Graph, cfg: RLHFConfig, gens: list[dict]) -> tuple[list[dict], dict]:
    """Score the policy's samples with the other roles (in parallel) and compute the per-token
    rewards, advantages and returns. One experience dict per data-parallel rank."""
    calls = {name: graph[name].scatter_async(method, gens) for name, method in (
        ("policy", "logprobs"), ("reference", "logprobs"), ("reward", "score"),
        ("critic", "values"))}
    got = {name: graph[name].get(refs, name) for name, refs in calls.items()}
    exps, kls, scores = [], [], []
    for r, g in enumerate(gens):
        mask = g["action"]
        rewards = ppo.kl_rewards(got["policy"][r], got["reference"][r], got["reward"][r], mask,
                                 cfg.ppo.kl_coef, cfg.ppo.clip_reward)
        adv, ret = ppo.gae(rewards, got["critic"][r], mask, cfg.ppo.gamma, cfg.ppo.lam)
        exps.append({"ids": g["ids"], "valid": g["valid"], "action": mask,
                     "old_logp": got["policy"][r], "old_values": got["critic"][r],
                     "adv": adv, "returns": ret})
        kls.append(((got["policy"][r] - got["reference"][r]) * mask).sum(1))
        scores.append(got["reward"][r])
    adv_all = torch.cat([e["adv"][e["action"] > 0] for e in exps])
    mean, std = adv_all.mean(), adv_all.std().clamp_min(1e-6)
    for e in exps:  # whiten advantages over the whole batch
        e["adv"] = (e["adv"] - mean) / std * e["action"]
    return exps, {"score": torch.cat(scores).mean().item(), "kl": torch.cat(kls).mean().item()}


def ppo_iteration(graph: Graph, cfg: RLHFConfig, data: Data, it: int,
                  rng: random.Random) -> dict:
    """Generate, score, and update policy and critic once; returns the iteration's metrics."""
    p, W = cfg.ppo, cfg.workers
    policy, critic = graph["policy"], graph["critic"]
    t0 = time.perf_counter()
    gens = policy.scatter("generate", rng.sample(data.prompts, p.prompts_per_iter), it)
    t1 = time.perf_counter()
    exps, stats = make_experience(graph, cfg, gens)
    t2 = time.perf_counter()
    for _ in range(p.ppo_epochs):
        ptx = [rng.sample(data.sft, max(1, p.prompts_per_iter // W)) for _ in range(W)] \
            if p.ptx_coef > 0 else [None] * W
        refs = [a.call.remote("ppo_step", (e, it, x), {}) for a, e, x in
                zip(policy.actors, exps, ptx)]
        c_refs = critic.scatter_async("critic_step", exps, it)
        pstats, cstats = policy.get(refs, "ppo_step"), critic.get(c_refs, "critic_step")
    rec = {"kind": "ppo", "step": it, **stats, "policy_loss": _mean(pstats, "policy_loss"),
           "value_loss": _mean(cstats, "value_loss"),
           "generate_s": t1 - t0, "score_s": t2 - t1, "train_s": time.perf_counter() - t2}
    if data.gold is not None:
        golds = [data.gold(q, r) for g in gens for q, r in zip(g["prompts"], g["responses"])]
        rec["gold"] = sum(golds) / len(golds)
    return rec


ROLES = ("policy", "reference", "reward", "critic")
TRAINED = ("policy", "critic")  # the roles whose PPO state checkpoints hold


def recover(graph: Graph, generation: int, timeout_s: float = 300.0) -> None:
    """Bring the graph back after a worker died and Ray restarted it: wait until every worker
    answers, rebuild every group under a new generation and build each role afresh (``setup``).
    The caller then puts the roles back at a checkpoint. A worker that cannot come back
    (restarts used up) raises WorkerDiedError naming the role, rank and cause."""
    for role in ROLES:
        graph[role].wait_ready(timeout_s)
    rewire(graph, generation, timeout_s)
    for role in ROLES:
        graph[role].call("setup")


def run_ppo(graph: Graph, cfg: RLHFConfig, data: Data, log: MetricsLog, out: Path,
            sft_path: Path, reward_path: Path, on_iteration: Callable | None = None,
            resume: bool = False) -> dict:
    """PPO for ``cfg.ppo.iterations`` iterations. Every ``checkpoint_every`` iterations the
    policy's and critic's full state (weights, optimizer shards, EMA, RNGs; the driver's
    sampling RNG in the manifest) goes to out/ppo/checkpoints/step-N, and the weights to
    out/ppo/iter-N/. When a worker of any role dies (or a call fails), Ray restarts it, the
    graph is rewired and every role goes back to the last checkpoint, up to ``cfg.max_restarts``
    times; the iterations after it are redone exactly. ``resume`` starts from the latest
    checkpoint that an earlier run left in ``out``. ``on_iteration(it, graph)`` is called
    before each iteration (again when one is redone)."""
    p = cfg.ppo
    root = out / "ppo" / "checkpoints"
    if not resume and root.exists():  # a fresh run must never go back to an older run's state
        shutil.rmtree(root)
    start = {"policy": ("begin_ppo", sft_path), "reference": ("load", sft_path),
             "reward": ("load", reward_path), "critic": ("begin_ppo", reward_path)}

    def restore() -> tuple[int, random.Random, dict | None]:
        """Every role at the start of PPO, then the trained ones at the latest checkpoint (if
        any); returns the iteration it was taken after, the driver's RNG and the evaluation
        before PPO."""
        refs = [(graph[r], graph[r].call_async(m, str(path))) for r, (m, path) in start.items()]
        for group, r in refs:
            group.get(r, "begin")
        rng = random.Random(cfg.seed + 30)
        source = checkpoint.latest(root)
        if source is None:
            if resume:
                logger.warning("no PPO checkpoint under %s: PPO starts from the beginning", root)
            return 0, rng, None
        done = checkpoint.restore([graph[r] for r in TRAINED], source, method="load_state")
        meta = read_manifest(source)
        version, state, gauss = meta["rng"]
        rng.setstate((version, tuple(state), gauss))
        return done, rng, meta["before"]

    it, rng, before = restore()
    if before is None:
        before = evaluate_policy(graph, data, cfg.seed + 99)
        log.write({"kind": "ppo_eval", "step": 0, **before})
    restarts = 0
    bar = tqdm(total=p.iterations, initial=it, desc="step 3: PPO")
    while it < p.iterations:
        try:
            if on_iteration is not None:
                on_iteration(it + 1, graph)
            rec = ppo_iteration(graph, cfg, data, it + 1, rng)
            log.write(rec)
            it += 1
            if it % p.eval_every == 0 or it == p.iterations:
                log.write({"kind": "ppo_eval", "step": it,
                           **evaluate_policy(graph, data, cfg.seed + 99)})
            if p.checkpoint_every and (it % p.checkpoint_every == 0 or it == p.iterations):
                _checkpoint(graph, root, out, it, rng, before)
            bar.update(1)
        except (WorkerDiedError, WorkerCallError) as e:
            if restarts >= cfg.max_restarts:
                _raise_death(graph, e.role)  # the dead worker, rather than its peer's error
                raise
            restarts += 1
            failed = it + 1
            recover(graph, generation=restarts)
            it, rng, _ = restore()
            log.write({"kind": "recovery", "step": it, "failed_step": failed, "role": e.role,
                       "rank": e.rank, "node_id": e.node_id, "error": str(e).splitlines()[0]})
            bar.reset(total=p.iterations)
            bar.update(it)
    bar.close()
    after = evaluate_policy(graph, data, cfg.seed + 99)
    return {"before": before, "after": after, "restarts": restarts}


def _checkpoint(graph: Graph, root: Path, out: Path, it: int, rng: random.Random,
                before: dict) -> None:
    """The policy's and critic's full state (atomically, the newest two kept), and their
    weights as out/ppo/iter-N/{policy,critic}.trp."""
    checkpoint.save([graph[r] for r in TRAINED], root, it, method="save_state",
                    rng=list(rng.getstate()), before=before)
    d = out / "ppo" / f"iter-{it:05d}"
    graph["policy"].call_rank(0, "save", str(d / "policy.trp"))
    graph["critic"].call_rank(0, "save", str(d / "critic.trp"))
    (d / "state.json").write_text(json.dumps({"iteration": it}))


def _raise_death(graph: Graph, role: str) -> None:
    """Raise WorkerDiedError (role, rank, cause) if a worker of ``role`` is dead."""
    graph[role].wait_ready(60)


def _mean(stats: list[dict], key: str) -> float:
    return sum(s[key] for s in stats) / len(stats)


def run(cfg: RLHFConfig, steps: tuple[str, ...] = STEPS, resume: bool = False) -> dict:
    """Run ``steps`` (a subset of "sft", "reward", "ppo", in that order) and return a summary;
    a later step alone uses the weights an earlier run left in ``out_dir``, and ``resume``
    continues PPO from its latest checkpoint there."""
    if resume and ("sft" in steps or "reward" in steps):
        raise ValueError("resume continues PPO from its checkpoint; run it with steps ('ppo',) "
                         "alone (steps 1 and 2 would change the weights PPO started from)")
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.model_dump(), indent=1))
    log, data = MetricsLog(out / "metrics.jsonl"), prepare_data(cfg)
    sft_path, reward_path = out / "sft" / "policy.trp", out / "reward" / "reward.trp"
    summary: dict = {}
    graph = build_graph(cfg)
    try:
        if "sft" in steps:
            run_sft(graph, cfg, data, log, out)
            summary["sft"] = evaluate_policy(graph, data, cfg.seed + 99)
            log.write({"kind": "sft_eval", "step": cfg.sft.steps, **summary["sft"]})
        if "reward" in steps:
            run_reward(graph, cfg, data, log, out)
            summary["reward_accuracy"] = log.records()[-1]["accuracy"]
        if "ppo" in steps:
            summary["ppo"] = run_ppo(graph, cfg, data, log, out, sft_path, reward_path,
                                     resume=resume)
    finally:
        graph.shutdown()
    plot(log.records(), out / "rlhf.png")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def plot(records: list[dict], path: Path) -> Path:
    """SFT loss, reward-model accuracy, PPO reward, KL and gold reward, one panel each."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(kind, key):
        return [(r["step"], r[key]) for r in records if r.get("kind") == kind and key in r]

    panels = [("SFT loss", [("train", series("sft", "loss"))]),
              ("reward model accuracy", [("train", series("reward", "accuracy")),
                                         ("held out", series("reward_eval", "accuracy"))]),
              ("PPO reward-model score", [("batch", series("ppo", "score"))]),
              ("KL to reference (per sequence)", [("batch", series("ppo", "kl"))]),
              ("gold reward", [("batch", series("ppo", "gold")),
                               ("held out", series("ppo_eval", "gold"))])]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (title, lines) in zip(axes, panels):
        for label, pts in lines:
            if pts:
                ax.plot(*zip(*pts), "o-" if len(pts) < 20 else "-", label=label, linewidth=0.9,
                        markersize=3)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if any(pts for _, pts in lines):
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
