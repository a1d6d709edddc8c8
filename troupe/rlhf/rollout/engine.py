"""The policy's rollout engine: what samples responses from the trained model's weights, in
the inference layout (eval mode, no autograd, KV cache, LoRA adapters fused into the weights,
INT8 weights when the recipe asks), through troupe.generation's continuous batcher and sampler.

The trained model (troupe.rlhf.roles.policy.Policy) owns the weights and hands them to the engine at
each rollout; the engine owns what only sampling needs (the tokenizer's prompt rendering, the
INT8 copy, the sampling settings), as verl separates an actor from its rollout. By default both
live in the policy's worker processes. With ``step3.rollout.replicas``, engines run on actors
of their own (``RolloutReplica``, the ``rollout`` role) with a copy of the weights that the
policy sends after each update (troupe.parallel.weight_sync); each rollout says which version
of the weights generated it.
"""

from __future__ import annotations

import copy
import time

import torch

from troupe.collectives import Communicator
from troupe.compression import quantize_model, requantize
from troupe.devices import precision_dtype, worker_device
from troupe.errors import TroupeError
from troupe.generation import ContinuousBatcher, SamplingParams
from troupe.generation.prefix_cache import PrefixCache
from troupe.models.lora import fuse_lora, unfuse_lora
from troupe.parallel import weight_sync
from troupe.parallel.tensor import splits_of, whole_shape
from troupe.rlhf.agents.environments import EnvironmentPool
from troupe.rlhf.agents.loop import AgentLoop, rollout_of
from troupe.rlhf.config import RLHFConfig
from troupe.rlhf.data.batch import prompts, response_mask
from troupe.rlhf.data.experience import Rollout, RolloutRequest
from troupe.rlhf.models.build import build_lm


class RolloutEngine:
    def __init__(self, cfg: RLHFConfig, tok):
        self.cfg, self.tok = cfg, tok
        self._int8: tuple | None = None  # (the model it copies, its INT8 copy)
        self._agent: AgentLoop | None = None  # multi-turn rollouts (env.function)

    @torch.no_grad()
    def generate(self, model: torch.nn.Module, request: RolloutRequest) -> Rollout:
        """Sample responses to the request's prompts from ``model``'s weights, one seed per
        prompt (with ``env.function``, multi-turn trajectories: troupe.rlhf.agents.loop); the model
        is left as it came (adapters unfused) whatever happens."""
        t0, p = time.perf_counter(), self.cfg.step3
        if not request.prompts:  # a rank with none of a small batch (held-out prompts)
            return Rollout(torch.zeros(0, 1, dtype=torch.long),  # host: a rollout (empty)
                           torch.zeros(0, 1, dtype=torch.bool),  # host: (as above)
                           torch.zeros(0, 0), [], [], groups=request.groups)  # host: (as above)
        model.eval()
        fused = p.lora.enabled and fuse_lora(model)
        try:
            temp = p.temperature if request.temperature is None else request.temperature
            engine = self._int8_engine(model) if p.int8_generation else model
            if self.cfg.env.function:
                rollout = self._trajectories(engine, request, temp,
                                             p.keep_decode_weights and engine is model)
                rollout.seconds, rollout.groups = time.perf_counter() - t0, request.groups
                return rollout
            params = [SamplingParams(max_tokens=p.max_new_tokens, temperature=temp,
                                     top_p=p.top_p, top_k=p.top_k, seed=seed, logprobs=0)
                      for seed in request.seeds]
            prompt_ids = [self.tok.prompt(t) for t in request.prompts]
            draft = self._int8_engine(model).gpt if p.speculate_draft == "w8a8" else None
            tokens, logprobs = engine.generate(
                prompt_ids, params, self.tok.eos_id, p.generation_batch,
                keep_packed=p.keep_decode_weights and engine is model,
                prefix_cache_mb=p.prefix_cache_mb, decode_graphs=self.cfg.decode_graphs,
                speculate=p.speculate, draft=draft)
        finally:
            if fused:
                unfuse_lora(model)
        rollout = self._rollout(request.prompts, tokens, logprobs)
        rollout.seconds, rollout.groups = time.perf_counter() - t0, request.groups
        rollout.prompt_tokens = (sum(map(len, prompt_ids)), engine.prefill_tokens)
        rollout.speculation = engine.speculation
        return rollout

    def _rollout(self, texts: list, tokens: list[list[int]],
                 logprobs: list[list[float]]) -> Rollout:
        """Prompts and sampled tokens as left-padded sequences with their masks, and the
        engine's log-probability of each sampled token where its target is (as ``action``)."""
        eos, N = self.tok.eos_id, self.cfg.step3.max_new_tokens
        p_ids, p_valid = prompts(self.tok, texts)
        resp = torch.tensor([t + [eos] * (N - len(t)) for t in tokens],  # host: a rollout
                            dtype=torch.long)
        rmask = response_mask(resp, eos)
        ids = torch.cat([p_ids, resp], 1)
        valid = torch.cat([p_valid, rmask.bool()], 1)
        P = p_ids.shape[1]
        action = torch.zeros(ids.shape[0], ids.shape[1] - 1, device=ids.device)
        action[:, P - 1:] = rmask  # target t+1 predicted at t
        engine_logp = torch.zeros_like(action)
        for i, lp in enumerate(logprobs):
            engine_logp[i, P - 1:P - 1 + len(lp)] = torch.tensor(lp)  # host: a rollout
        responses = [self.tok.decode([i for i in t if i != eos]) for t in tokens]
        return Rollout(ids, valid, action, list(texts), responses, prompt_len=P,
                       engine_logp=engine_logp * action)

    def _trajectories(self, lm, request: RolloutRequest, temperature: float,
                      keep_packed: bool) -> Rollout:
        """Multi-turn trajectories, one per prompt, with the recipe's environment (its pool of
        processes started at the first call, kept for the engine's life)."""
        e, p = self.cfg.env, self.cfg.step3
        if self._agent is None:
            pool = EnvironmentPool(e.function, e.workers, e.timeout_s, e.memory_mb,
                                   kwargs=e.kwargs)
            self._agent = AgentLoop(self.tok, pool, e.max_turns, e.max_tokens,
                                    p.max_new_tokens, e.tools)
        packed = lm.packed_weights() if keep_packed else True
        engine = ContinuousBatcher(lm.gpt, self.tok.eos_id, max_batch=p.generation_batch or 16,
                                   tokenizer=self.tok.hf, packed_decode=packed,
                                   prefix_cache=PrefixCache(int(max(p.prefix_cache_mb, 64) * 2**20)),
                                   keep_outputs=True, speculate=p.speculate)
        rows = [{"prompt": q, **f} for q, f in
                zip(request.prompts, request.fields or [{}] * len(request.prompts))]
        trajs = self._agent.run(engine, rows, request.seeds, temperature, p.top_p, p.top_k)
        rollout = rollout_of(trajs, self.tok, e.failure_score)
        opening = sum(len(t.prompt_ids) + len(t.tokens) - sum(t.generated) for t in trajs)
        rollout.prompt_tokens = (opening, engine.prefill_tokens)
        rollout.speculation = tuple(engine.speculation.values())
        return rollout

    def _int8_engine(self, model: torch.nn.Module) -> torch.nn.Module:
        """The inference layout with INT8 weights: a copy whose linear layers run W8A8 (the
        tied output embedding stays fp32), made at the first rollout and re-quantized in
        place from the policy's current weights at each later one (the policy changes only
        between rollouts: once per update)."""
        if self._int8 is None or self._int8[0] is not model:
            engine = copy.deepcopy(model)
            quantize_model(engine, {"*": "w8a8"})
            self._int8 = (model, engine)
        else:
            requantize(self._int8[1], model)
        return self._int8[1]


class ReplicaRestarted(TroupeError):
    """A call reached a rollout replica that Ray restarted and the driver has not set up yet
    (a call sent while it was restarting runs on the new process): the driver treats it as
    the replica's death."""

    def __init__(self, rank: int):
        self.rank = rank
        super().__init__(f"rollout replica {rank} was restarted and is not set up yet")


class RolloutReplica:
    """One engine replica of the ``rollout`` role: the policy's architecture in the inference
    layout, its weights whatever version the policy last sent (none until the first sync:
    it refuses to generate before), and the engine that samples from them."""

    def __init__(self, cfg: RLHFConfig, rank: int, tp: Communicator | None = None):
        """``rank``: this actor's in the role; ``tp``: the ranks of its replica
        (step3.rollout.tensor_parallel), over which its model is split."""
        self.cfg, self.rank = cfg, rank
        self.device = worker_device(cfg.device)
        self.lm, self.tok = build_lm(cfg.model, cfg.seed, cfg.precision, device=self.device,
                                     tools=cfg.env.tools, tp=tp, training=False)
        self.lm.eval().requires_grad_(False)
        self.lm.gpt.to(precision_dtype(cfg.step3.rollout.precision))  # held, synced so
        self.engine = RolloutEngine(cfg, self.tok)
        self.version: int | None = None

    def receive(self, group: Communicator, version: int) -> dict:
        """The policy's weights of ``version`` (troupe.parallel.weight_sync.receive); a sync
        that fails leaves this replica without a usable version until the next one."""
        r = self.cfg.step3.rollout
        self.version = None
        gpt = self.lm.gpt
        mine = weight_sync.sync_tensors(gpt)
        # a split replica: the whole tensors arrive (whatever the policy's layout), then each
        # rank keeps its shard of them
        splits = splits_of(gpt)
        arriving = [(name, t.new_empty(whole_shape(gpt, name, t.shape)) if name in splits
                     else t) for name, t in mine]
        report = weight_sync.receive(group, arriving, version, int(r.bucket_mb * 2**20),
                                     r.sync_timeout_s)
        with torch.no_grad():
            for (name, t), (_, whole) in zip(mine, arriving):
                if whole is not t:
                    t.copy_(splits[name].shard(whole, gpt.tp.rank))
        self.version = version
        return vars(report)

    def generate(self, request: RolloutRequest) -> Rollout:
        if self.version is None:
            raise RuntimeError(f"rollout replica {self.rank} has no weights: its last sync "
                               "failed or none has happened yet")
        rollout = self.engine.generate(self.lm, request)
        rollout.versions = [self.version] * len(rollout.responses)
        return rollout
