"""The four RLHF roles as graph workers: thin shells that build the plain role classes of
troupe.rlhf.roles.policy once their data-parallel groups are wired ("policy", "critic", "reward"),
and declare how the driver's calls are dispatched (troupe.actors.dispatch). Batches the driver
sends arrive in host memory and are moved to the worker's device here (``_here``); what a call
returns goes back to host memory in troupe.actors.worker."""

from __future__ import annotations

import torch

from troupe import checkpoint as ckpt
from troupe.actors import Dispatch, dispatch
from troupe.config import validate
from troupe.context import get_context
from troupe.devices import move, worker_device
from troupe.rlhf.config import RLHFConfig
from troupe.rlhf.data.experience import (
    CriticStats,
    DPOStats,
    Experience,
    PolicyStats,
    PreferenceBatch,
    RewardEval,
    RewardStats,
    Rollout,
    RolloutRequest,
    SFTStats,
)
from troupe.rlhf.roles.policy import Policy
from troupe.rlhf.roles.reference import Reference
from troupe.rlhf.roles.topology import RLHFTopology
from troupe.rlhf.roles.value import Critic, Reward
from troupe.rlhf.rollout.engine import ReplicaRestarted, RolloutReplica
from troupe.runtime.metrics import peak_memory_mb
from troupe.runtime.topology import communicator


def _config(config: dict | RLHFConfig) -> RLHFConfig:
    return config if isinstance(config, RLHFConfig) else validate(RLHFConfig, config,
                                                                  "rlhf config")


class _Shell:
    """What every role shell shares: the recipe, the plain role built by ``setup`` once the
    groups are wired, and loading weights."""

    def __init__(self, config: dict | RLHFConfig):
        self.cfg = _config(config)
        torch.set_num_threads(self.cfg.step3.threads)  # reference and critic work in step 3 only
        self.device = worker_device(self.cfg.device)
        self.role = None

    @dispatch(Dispatch.ALL)
    def configure(self, config: dict) -> None:
        """Another recipe for this worker, its role dropped (``setup`` builds it afresh): a
        graph reused for another run of the same roles and ranks (troupe.rlhf.driver.run)."""
        self.__dict__.clear()
        type(self).__init__(self, config)

    def _here(self, batch):
        """A batch from the driver (a Rollout, Experience, ...) on this worker's device."""
        return move(batch, self.device)

    @dispatch(Dispatch.ALL)
    def device_name(self) -> str:
        """Where this worker computes ("cpu", "cuda:0")."""
        return str(self.device)

    @dispatch(Dispatch.ALL)
    def peak_memory_mb(self) -> float:
        """This worker's peak memory so far (troupe.runtime.metrics.peak_memory_mb)."""
        return peak_memory_mb()

    @dispatch(Dispatch.ALL)
    def load(self, path: str) -> None:
        """Weights for step 3 (where the roles compute side by side: step3.threads)."""
        torch.set_num_threads(self.cfg.step3.threads)
        self.role.load(path)


class ReferenceCalls:
    """What the frozen reference answers, wherever it lives: in its own role's workers
    (ReferenceActor) or in the policy's (``reference_in_policy``: one process fewer per rank,
    as verl's actor-rollout-reference worker). The driver finds it with ``reference_of``."""

    reference: Reference | None = None

    @dispatch(Dispatch.ALL)
    def load_reference(self, path: str) -> None:
        self.reference.load(path)

    @dispatch(Dispatch.SHARD)
    def reference_logprobs(self, rollout: Rollout) -> torch.Tensor:
        """(B, S-1) log-probabilities of the rollout's response tokens under the reference."""
        r = self._here(rollout)
        return self.reference.logprobs(r.ids, r.valid, r.action, r.prompt_len)

    @dispatch(Dispatch.SHARD)
    def reference_pair_logprobs(self, pairs: list) -> torch.Tensor:
        """(B, 2) summed log-probabilities of each (prompt, chosen, rejected) row's responses."""
        return self.reference.pair_logprobs(pairs)


def reference_of(graph, cfg: RLHFConfig):
    """The role whose workers hold the reference model."""
    return graph["policy"] if cfg.reference_in_policy else graph["reference"]


class _TrainedShell(_Shell):
    """A role whose PPO state checkpoints hold (policy, critic): this rank's file is
    <directory>/<NAME>-RRRRR.trp."""

    NAME = ""

    @dispatch(Dispatch.ALL)
    def save_state(self, directory: str) -> dict:
        """Write this rank's PPO state; returns its manifest entry."""
        return ckpt.write_rank(directory, get_context().rank, self.role.state_dict(),
                               prefix=self.NAME)

    @dispatch(Dispatch.ALL)
    def load_state(self, directory: str) -> None:
        rank = get_context().rank
        state = ckpt.read_rank(directory, rank, ckpt.read_manifest(directory), prefix=self.NAME)
        self.role.load_state_dict(state, str(ckpt.rank_file(directory, rank, self.NAME)))


class PolicyActor(_TrainedShell, ReferenceCalls):
    NAME = "policy"

    @dispatch(Dispatch.ALL)
    def setup(self, topology: RLHFTopology) -> None:
        rank = get_context().rank
        group, tp = communicator(topology.policy), communicator(topology.policy_tp)
        self.role = Policy(self.cfg, group, rank, tp)
        if self.cfg.reference_in_policy and self.cfg.uses_reference():
            self.reference = Reference(self.cfg, rank, group, tp)

    @dispatch(Dispatch.ALL)
    def start_sft(self, total_steps: int) -> None:
        torch.set_num_threads(self.cfg.threads)  # the policy computes alone in step 1
        self.role.train.use_optimizer(self.cfg.sft.optimizer, total_steps)

    @dispatch(Dispatch.SHARD)
    def sft_step(self, pairs: list[tuple[str, str]], step: int) -> SFTStats:
        return self.role.sft_step(pairs, step)

    @dispatch(Dispatch.ALL)
    def end_sft(self) -> None:
        """Step 1 is over: its optimizer state goes (PPO starts its own)."""
        self.role.train.drop_optimizer()

    @dispatch(Dispatch.ALL)
    def begin_step3(self, sft_path: str | None) -> None:
        """Step 3 (any algorithm) from the SFT weights (None: the model's own)."""
        torch.set_num_threads(self.cfg.step3.threads)
        self.role.begin_step3(sft_path)

    @dispatch(Dispatch.SHARD)
    def generate(self, request: RolloutRequest) -> Rollout:
        return self.role.generate(request)

    @dispatch(Dispatch.ALL)
    def send_weights(self, topology: RLHFTopology, version: int,
                     background: bool = False) -> dict | None:
        """The weights as ``version`` to the rollout replicas (rank 0's report; None on the
        other ranks); ``background``: sent from a thread while the policy goes on."""
        return self.role.send_weights(communicator(topology.weights), version, background)

    @dispatch(Dispatch.ALL)
    def sync_done(self) -> dict | None:
        """The background sync's report once it has finished (rank 0's; None without one)."""
        return self.role.sync_done()

    @dispatch(Dispatch.SHARD)
    def logprobs(self, rollout: Rollout) -> torch.Tensor:
        """(B, S-1) log-probabilities of the rollout's response tokens (0 elsewhere)."""
        r = self._here(rollout)
        return self.role.logprobs(r.ids, r.valid, r.action, r.prompt_len)

    @dispatch(Dispatch.SHARD)
    def rl_step(self, exp: Experience, iteration: int,
                 ptx: list[tuple[str, str]] | None = None) -> PolicyStats:
        return self.role.rl_step(self._here(exp), iteration, ptx)

    @dispatch(Dispatch.SHARD)
    def dpo_step(self, batch: PreferenceBatch, step: int) -> DPOStats:
        return self.role.dpo_step(self._here(batch), step)

    @dispatch(Dispatch.ALL)
    def save(self, path: str, ema: bool = False) -> str:
        """Rank 0 writes; every rank takes part (a partitioned policy gathers)."""
        return self.role.save(path, ema)

    @dispatch(Dispatch.ALL)
    def export(self, directory: str) -> str:
        """The policy as a Hugging Face directory that transformers loads (rank 0 writes)."""
        return self.role.export(directory)


class ReferenceActor(_Shell, ReferenceCalls):

    @dispatch(Dispatch.ALL)
    def setup(self, topology: RLHFTopology) -> None:
        self.role = self.reference = Reference(self.cfg, get_context().rank,
                                               communicator(topology.reference),
                                               communicator(topology.reference_tp))


class RewardCalls:
    """What the reward model answers (step 2's training, step 3's scores), wherever it
    lives: in its own role's workers (RewardActor) or in the critic's (``reward_in_critic``:
    one process fewer per rank; it trains there in step 2 with the critic's data-parallel
    group). The driver finds it with ``reward_of``."""

    reward_model: Reward | None = None

    @dispatch(Dispatch.ALL)
    def start_reward_training(self, total_steps: int, init_path: str | None = None) -> None:
        torch.set_num_threads(self.cfg.threads)  # the reward model computes alone in step 2
        if init_path is not None:
            self.reward_model.init_from_policy(init_path)
        self.reward_model.train.use_optimizer(self.cfg.reward.optimizer, total_steps)

    @dispatch(Dispatch.SHARD)
    def rm_step(self, examples: list[tuple[str, str, str]], step: int) -> RewardStats:
        return self.reward_model.rm_step(examples, step)

    @dispatch(Dispatch.SHARD)
    def rm_evaluate(self, examples: list[tuple[str, str, str]]) -> RewardEval:
        return self.reward_model.evaluate(examples)

    @dispatch(Dispatch.ALL)
    def save_reward(self, path: str) -> str:
        return self.reward_model.save(path)

    @dispatch(Dispatch.ALL)
    def load_reward(self, path: str) -> None:
        """The trained reward model for step 3, frozen (its training state freed first)."""
        torch.set_num_threads(self.cfg.step3.threads)
        self.reward_model.load(path)

    @dispatch(Dispatch.SHARD)
    def reward_score(self, rollout: Rollout) -> torch.Tensor:
        """(B,) the reward model's score of each sequence."""
        r = self._here(rollout)
        return self.reward_model.score(r.ids, r.valid, r.prompt_len)


def reward_of(graph, cfg: RLHFConfig):
    """The role whose workers hold the reward model."""
    return graph["critic"] if cfg.reward_in_critic else graph["reward"]


class RewardActor(_Shell, RewardCalls):

    @dispatch(Dispatch.ALL)
    def setup(self, topology: RLHFTopology) -> None:
        self.role = self.reward_model = Reward(self.cfg, communicator(topology.reward),
                                               get_context().rank,
                                               communicator(topology.reward_tp))


class CriticActor(_TrainedShell, RewardCalls):
    NAME = "critic"

    @dispatch(Dispatch.ALL)
    def setup(self, topology: RLHFTopology) -> None:
        group, rank = communicator(topology.critic), get_context().rank
        tp = communicator(topology.critic_tp)
        if self.cfg.reward_in_critic and self.cfg.uses_reward_model():
            self.reward_model = Reward(self.cfg, group, rank, tp)
        self.role = Critic(self.cfg, group, rank, tp)

    @dispatch(Dispatch.ALL)
    def begin_step3(self, reward_path: str | None, sft_path: str | None = None) -> None:
        self.role.begin_step3(reward_path, sft_path)

    @dispatch(Dispatch.SHARD)
    def values(self, rollout: Rollout) -> torch.Tensor:
        """(B, S-1) the value of the state before each target."""
        r = self._here(rollout)
        return self.role.values(r.ids, r.valid, r.prompt_len)

    @dispatch(Dispatch.SHARD)
    def critic_step(self, exp: Experience, iteration: int) -> CriticStats:
        return self.role.critic_step(self._here(exp), iteration)

    @dispatch(Dispatch.ALL)
    def save(self, path: str) -> str:
        """Rank 0 writes; every rank takes part (a partitioned critic gathers)."""
        return self.role.save(path)


class RolloutActor(_Shell):
    """A replica of the ``rollout`` role (step3.rollout.replicas): generates what the driver
    asks with the weights the policy last sent it."""

    def __init__(self, config: dict | RLHFConfig):
        super().__init__(config)
        torch.set_num_threads(self.cfg.step3.rollout.threads or self.cfg.step3.threads)

    @dispatch(Dispatch.ALL)
    def setup(self, topology: RLHFTopology) -> None:
        self.role = RolloutReplica(self.cfg, get_context().rank,
                                   communicator(topology.rollout_tp))

    def _replica(self) -> RolloutReplica:
        if self.role is None:  # Ray restarted this process; the driver has not set it up
            raise ReplicaRestarted(get_context().rank)
        return self.role

    @dispatch(Dispatch.ALL)
    def receive_weights(self, topology: RLHFTopology, version: int) -> dict:
        """The policy's weights as ``version`` (this replica's report of the sync)."""
        return self._replica().receive(communicator(topology.weights), version)

    @dispatch(Dispatch.SHARD)
    def generate(self, request: RolloutRequest) -> Rollout:
        return self._replica().generate(request)

    @dispatch(Dispatch.ALL)
    def version(self) -> int | None:
        """The version of the weights this replica holds (None: none usable)."""
        return self._replica().version
