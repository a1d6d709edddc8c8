"""The policy (actor): SFT in step 1; in step 3 it generates in its inference layout (eval
mode, no autograd, KV cache, LoRA fused) and trains with the clipped surrogate of the recipe's
algorithm (PPO, GRPO, RLOO, REINFORCE++: they differ in their advantages, which arrive in the
experience, and in where the KL goes) or with DPO's loss; it sends its weights to the rollout
replicas (troupe.parallel.weight_sync). One data-parallel rank of the role (troupe.rlhf.roles)."""

from __future__ import annotations

import copy

import torch

from troupe.collectives import Communicator
from troupe.data import micro_batches
from troupe.devices import move, precision_dtype, rng_state, set_rng_state, worker_device
from troupe.models import save_pretrained
from troupe.models.lora import fuse_lora, inject_lora, merged_state_dict, unfuse_lora
from troupe.parallel import weight_sync
from troupe.rlhf import algorithms
from troupe.rlhf.config import RLHFConfig
from troupe.rlhf.data.batch import split_completions
from troupe.rlhf.data.experience import (
    DPOStats,
    Experience,
    PolicyStats,
    PreferenceBatch,
    Rollout,
    RolloutRequest,
    SFTStats,
)
from troupe.rlhf.models.build import Trainable, build_lm, build_trainable
from troupe.rlhf.models.lm import GPTLM
from troupe.rlhf.rollout.engine import RolloutEngine


class Policy:
    """``rank``: this process's rank in the role; ``group``: its data-parallel group; ``tp``:
    its tensor-parallel group (the ranks holding one model between them, which draw the same
    dropout and generate the same tokens together)."""

    def __init__(self, cfg: RLHFConfig, group: Communicator | None, rank: int,
                 tp: Communicator | None = None):
        self.cfg, self.rank = cfg, rank
        torch.manual_seed(cfg.seed * 1000 + rank // cfg.tp_of("policy"))
        self.device = worker_device(cfg.device)
        self.lm, self.tok = build_lm(cfg.model, cfg.seed, cfg.precision, device=self.device,
                                     tools=cfg.env.tools, tp=tp)
        self.train = build_trainable(self.lm, self.lm.gpt.blocks, group, cfg, self.device, tp)
        self.ema = None
        self.algorithm = cfg.algo()
        self.engine = RolloutEngine(cfg, self.tok)
        self.sending: weight_sync.BackgroundSend | None = None  # a sync still on its way
        self.staged: weight_sync.Staged | None = None  # its copy of the weights, kept for reuse

    # step 1 ---------------------------------------------------------------------------------
    def sft_step(self, pairs: list[tuple[str, str]], step: int) -> SFTStats:
        self.lm.train()
        loss = self._lm_loss(pairs, self.cfg.sft.micro_batch_size)
        return SFTStats(loss, self.train.step(step))

    def _lm_loss(self, pairs: list[tuple[str, str]], micro: int | None,
                 coef: float = 1.0) -> float:
        """Backward of ``coef`` x the mean next-token loss on the responses of (prompt,
        response) pairs, micro-batch by micro-batch; returns the loss."""
        *batch, P = split_completions(self.tok, [p for p, _ in pairs], [r for _, r in pairs])
        ids, valid, mask = move(batch, self.device)
        total, loss = mask.sum().clamp_min(1), 0.0
        for s in self.lm.micro_batches(valid, micro):
            logp = self.lm.token_logprobs(ids[s], valid[s], mask[s], prompt_len=P)
            part = -(logp * mask[s]).sum() / total
            self.train.backward(coef * part)
            loss += part.item()
        return loss

    # step 3 ---------------------------------------------------------------------------------
    def begin_step3(self, sft_path: str | None) -> None:
        """Step 3 starts from the SFT weights (None: from the model's own)."""
        if sft_path is not None:
            self.train.load(sft_path, self.lm)
        if not self.algorithm.online:
            d = self.cfg.dpo
            self.train.use_optimizer(d.optimizer, d.steps)
            return
        if self.cfg.step3.lora.enabled:
            inject_lora(self.lm, self.cfg.step3.lora.rank, self.cfg.step3.lora.alpha)
            self.train = Trainable(self.lm, self.train.group,  # only the adapters train
                                   self.cfg.precision)
        p = self.cfg.step3
        self.train.use_optimizer(p.actor, p.iterations * p.ppo_epochs)
        if self.cfg.step3.ema:
            self.ema = copy.deepcopy(self.lm)

    def generate(self, request: RolloutRequest) -> Rollout:
        """Responses from the rollout engine, with the current weights (the EMA's if asked)."""
        model = self.ema if request.use_ema and self.ema is not None else self.lm
        if self.cfg.step3.release_memory:
            self.train.free_grads()  # zero between updates: nothing is lost
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        with self.train.gathered():  # a partitioned policy: gathered once per rollout
            return self.engine.generate(model, request)

    def send_weights(self, group: Communicator | None, version: int,
                     background: bool = False) -> dict | None:
        """The current weights, as ``version``, to the rollout replicas of ``group`` (rank 0
        sends; every rank calls: a partitioned policy's parameters are gathered unit by unit
        as the buckets are packed, never the whole model on one rank); LoRA adapters are
        folded in for the sync and taken out after. Returns rank 0's report. ``background``
        (host weights, zero_stage 1): the weights are staged, a copy of their bytes, and sent
        from a thread while this policy goes on (the report's ``seconds`` is None;
        ``sync_done`` gives the transfer's). A sync still on its way is finished first."""
        self.sync_done()
        r = self.cfg.step3.rollout
        dtype, bucket = precision_dtype(r.precision), int(r.bucket_mb * 2**20)
        partitioned = self.cfg.zero_stage != 1
        split = self.lm.gpt.tp is not None
        trained = self.train.zero3.take_peak() if partitioned else None  # since the last sync
        if self.rank != 0 or group is None:
            if partitioned or split:  # its gathers are collectives: every rank walks the stream
                for _ in self.train.stream(self.lm.gpt):
                    pass
            return None
        fused = fuse_lora(self.lm)
        try:
            if background and self.device.type == "cpu" and not (partitioned or split):
                reuse = None if self.staged is None else self.staged.buffer
                self.staged = weight_sync.stage(weight_sync.sync_tensors(self.lm.gpt, dtype),
                                                bucket, into=reuse)
                self.sending = weight_sync.BackgroundSend(group, self.staged, version,
                                                          r.sync_timeout_s)
                return {"version": version, "buckets": self.sending.buckets,
                        "bytes": self.sending.nbytes, "seconds": None}
            report = weight_sync.send_stream(
                group, weight_sync.sync_specs(self.lm.gpt, dtype),
                weight_sync.sync_stream(self.train.stream(self.lm.gpt), dtype), version,
                bucket, r.sync_timeout_s, self.device)
        finally:
            if fused:
                unfuse_lora(self.lm)
        if partitioned:  # what was whole at once: syncing, training, and the plan's bound
            z = self.train.zero3
            return {**vars(report), "sync_gathered_peak_bytes": z.take_peak(),
                    "train_gathered_peak_bytes": trained,
                    "planned_gathered_bytes": z.memory()["gathered_bytes"]}
        return vars(report)

    def sync_done(self) -> dict | None:
        """The report of the background sync on its way (waiting for it; its error raised
        here), or None when there is none."""
        sending, self.sending = self.sending, None
        return None if sending is None else vars(sending.result())

    def logprobs(self, ids: torch.Tensor, valid: torch.Tensor, action: torch.Tensor,
                 prompt_len: int = 0) -> torch.Tensor:
        out = action_logprobs(self.lm, ids, valid, action, self.cfg.step3.micro_batch_size,
                              prompt_len)
        self.train.settle()
        return out

    def rl_step(self, exp: Experience, iteration: int,
                 ptx: list[tuple[str, str]] | None) -> PolicyStats:
        """One update on the experience: the algorithm's surrogate (its ratio against the
        sampling policy's log-probabilities, or 1 when the experience has none: a single
        on-policy epoch), plus the KL to the reference when it is a loss term, averaged over
        the batch's units (tokens, or sequences for a sequence-level loss)."""
        self.lm.train()
        self.lm.padding = [0, 0, 0, 0]
        p, cfg, alg = self.cfg.step3, self.cfg, self.algorithm
        kl_coef = cfg.kl_coef() if cfg.kl_in_loss() else 0.0
        clip, clip_high = cfg.clip()
        total, tokens = alg.loss_units(exp.action).clamp_min(1), exp.action.sum().clamp_min(1)
        policy_loss, kl_sum, ent_sum, clip_sum, ptx_loss = 0.0, 0.0, 0.0, 0.0, None
        mismatch = [0.0, 0.0, 0.0]
        for s in self.lm.micro_batches(exp.valid, p.micro_batch_size):
            mask = exp.action[s]
            logp, ent = self.lm.token_logprobs(exp.ids[s], exp.valid[s], mask, entropy=True,
                                               prompt_len=exp.prompt_len)
            old = exp.old_logp[s] if exp.old_logp is not None else logp.detach()
            adv = exp.advantages[s]
            if exp.engine_logp is not None:
                adv = _engine_correction(old, exp.engine_logp[s], mask, adv, cfg.tis_cap(),
                                         mismatch)
            surrogate, clipped = alg.policy_loss(logp, old, adv, mask, clip, clip_high)
            loss = alg.loss_units(mask) / total * surrogate  # its share of the batch's mean
            policy_loss += loss.item()
            if kl_coef > 0:
                kl = algorithms.masked_mean(
                    algorithms.kl_estimate(logp, exp.ref_logp[s], cfg.kl_estimator()), mask)
                loss = loss + mask.sum() / tokens * kl_coef * kl
                kl_sum += (mask.sum() / tokens * kl).item()
            self.train.backward(loss)
            ent_sum += (ent * mask).sum().item()
            clip_sum += (clipped * mask.sum()).item()
        if ptx and p.ptx_coef > 0:
            ptx_loss = self._lm_loss(ptx, p.micro_batch_size, p.ptx_coef)
        self.train.step(iteration)
        if self.ema is not None:
            algorithms.ema_update(self.ema, self.lm, self.cfg.step3.ema_beta)
        n = int(tokens.item())
        return PolicyStats(policy_loss, ptx_loss, kl_sum if kl_coef > 0 else None,
                           ent_sum / n, clip_sum / n, n, mismatch=tuple(mismatch),
                           padding=tuple(self.lm.padding))

    # DPO ------------------------------------------------------------------------------------
    def dpo_step(self, batch: PreferenceBatch, step: int) -> DPOStats:
        """One DPO update on this rank's pairs (their reference log-probabilities given)."""
        self.lm.train()
        d, B = self.cfg.dpo, len(batch.pairs)
        loss_sum, margins = 0.0, []
        for s in micro_batches(B, d.micro_batch_size):
            chosen, rejected, n_chosen = pair_logprobs(self.lm, self.tok, batch.pairs[s])
            loss, margin = algorithms.dpo_loss(chosen, rejected, batch.ref_chosen[s],
                                               batch.ref_rejected[s], d.beta, d.loss,
                                               d.label_smoothing)
            if d.sft_coef > 0:  # RPO: the chosen responses' per-token NLL
                loss = loss + d.sft_coef * (-chosen / n_chosen).mean()
            part = loss * len(chosen) / B
            self.train.backward(part)
            loss_sum += part.item()
            margins.append(margin)
        margin = torch.cat(margins)
        return DPOStats(loss_sum, margin.mean().item(), (margin > 0).float().mean().item(),
                        self.train.step(step))

    def save(self, path: str, ema: bool = False) -> str:
        """Rank 0 writes the weights (every rank calls: a partitioned policy gathers, a
        tensor-parallel one puts its shards together)."""
        self.train.save(path, self.ema if ema and self.ema is not None else self.lm,
                        self.rank == 0, kind="policy")
        return path

    def export(self, directory: str) -> str:
        """The policy as a Hugging Face directory (adapters folded in), with the tokenizer
        files of the model it started from; written by rank 0, every rank calls."""
        gpt = self.lm.gpt
        with self.train.gathered():
            whole = self.train.put_together(gpt)
            if self.rank == 0:
                save_pretrained(gpt, directory, self.cfg.model.pretrained,
                                state=merged_state_dict(gpt) if whole is None else whole)
        return directory

    def state_dict(self) -> dict:
        """What PPO needs to go on exactly from here (after ``begin_step3``): trainable weights,
        this rank's optimizer state, the EMA weights and the torch RNG."""
        ema = None if self.ema is None else {k: v.clone() for k, v in self.ema.state_dict().items()}
        return {"train": self.train.state_dict(), "ema": ema, **rng_state(self.device)}

    def load_state_dict(self, state: dict, where: str) -> None:
        self.train.load_state_dict(state["train"], where)
        if (self.ema is None) != (state["ema"] is None):
            raise ValueError(f"{where}: saved {'with' if state['ema'] is not None else 'without'}"
                             f" EMA weights, but step3.ema={self.ema is not None}")
        if self.ema is not None:
            try:
                self.ema.load_state_dict(state["ema"])
            except RuntimeError as e:  # missing, unexpected or misshapen keys
                raise ValueError(f"{where}: EMA weights: {e}") from None
        set_rng_state(state, self.device)

    def load(self, path: str) -> None:
        self.train.load(path, self.lm)


@torch.no_grad()
def _engine_correction(trainer_logp: torch.Tensor, engine_logp: torch.Tensor,
                       mask: torch.Tensor, adv: torch.Tensor, cap: float | None,
                       mismatch: list[float]) -> torch.Tensor:
    """The advantages weighted by truncated importance sampling, min(p_trainer / p_engine,
    ``cap``) per response token (unchanged when ``cap`` is None), and the mismatch counted
    into ``mismatch`` (sum and max of |log-ratio|, tokens truncated). A weight w > 0 on the
    advantage is a weight on the token's clipped surrogate: -min(rwA, clip(r)wA) =
    w * -min(rA, clip(r)A)."""
    log_ratio = (trainer_logp - engine_logp) * mask
    mismatch[0] += log_ratio.abs().sum().item()
    mismatch[1] = max(mismatch[1], log_ratio.abs().max().item() if mask.any() else 0.0)
    if cap is None:
        return adv
    ratio = log_ratio.exp()
    mismatch[2] += ((ratio > cap) & mask.bool()).sum().item()
    return adv * ratio.clamp(max=cap)


@torch.no_grad()
def action_logprobs(lm: GPTLM, ids: torch.Tensor, valid: torch.Tensor, action: torch.Tensor,
                    micro: int | None, prompt_len: int = 0) -> torch.Tensor:
    """(B, S-1) log-probabilities of a rollout's response tokens (0 elsewhere), in eval mode,
    ``micro`` sequences at a time (a prompt shared by consecutive rows runs once)."""
    lm.eval()
    return torch.cat([lm.token_logprobs(ids[s], valid[s], action[s], prompt_len=prompt_len)
                      for s in lm.micro_batches(valid, micro)])


def pair_logprobs(lm: GPTLM, tok, pairs: list):
    """Summed response log-probabilities (B,) of the chosen and of the rejected responses of
    (prompt, chosen, rejected) rows, in one batch of 2B sequences, and the chosen responses'
    token counts (B,)."""
    # each prompt's chosen and rejected side by side: the prompt runs once for both
    prompts = [p for p, _, _ in pairs for _ in range(2)]
    *batch, P = split_completions(tok, prompts, [x for _, c, r in pairs for x in (c, r)])
    ids, valid, mask = move(batch, lm.device)
    total = (lm.token_logprobs(ids, valid, mask, prompt_len=P) * mask).sum(1)
    return total[0::2], total[1::2], mask[0::2].sum(1)
