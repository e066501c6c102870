"""`Expert`: one expert's trainable state (model, frozen reference, optimizer) and its version.

Its version is 0 at start and +1 per applied update. `update` is idempotent by step, so a retried
call never applies an update twice, and refuses to start from a version it does not hold, so a
restarted instance is restored first instead of silently starting over. What the update computes
(model, batch merging, loss) is the expert's kind's (experts/kinds.py). An expert of several ranks
(`parallel.ranks` > 1) is one such object per process, joined into one process group
(`join_gang`): each computes its share of the update and only the leader (rank 0) hands out
weights and snapshots, whole (experts/parallel.py). A model built in a low-precision dtype keeps
what it trains in fp32 and computes in its own dtype (experts/precision.py).
"""
from __future__ import annotations

import math
from pathlib import Path
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from experts import parallel, precision, state_file
from experts.kinds import expert_kind
from experts.parallel import Gang, GangSpec
from experts.records import ExpertInfo, OptimizerShard, ShardFiles, Snapshot
from experts.weights import (arrays_of, fingerprint, is_lora, load, model_tensors, optimizer_arrays, optimizer_tensors,
                             reference_of, synced_state)


class StaleExpert(RuntimeError):
    """An expert asked to update from a version it does not hold (it restarted and lost its state)."""


class GangBroken(StaleExpert):
    """A rank of a several-rank expert lost a peer during a collective (or its process group is
    not the gang's current one): the gang is formed again and restored before the call is retried."""


class Expert:
    def __init__(self, config, expert_id: str, device: torch.device = torch.device("cpu"), private: bool = True):
        """`private`: weights and snapshots leave as copies that a later update cannot change
        (False: as views of the model's tensors, for a caller that copies them out at once)."""
        self.expert_id, self.config, self.device, self.private = expert_id, config, device, private
        self.kind = expert_kind(config, expert_id)
        self.spec = self.kind.spec
        self.gang: Gang | None = None
        self.build(*self.fresh(device))
        self.version = 0
        self.last_step, self.last_stats = -1, {}

    def fresh(self, device: torch.device) -> tuple[torch.nn.Module, Any]:
        """The model at version 0 on `device` and its frozen reference, which stays in the model's
        dtype; then its trained parameters kept in fp32, noting in `self.computed` the dtype each
        is computed in (experts/precision.py)."""
        model = self.kind.build_model(device=device).to(device)  # a pretrained model loads onto `device`
        reference = reference_of(model)
        self.computed = precision.keep_trained_in_fp32(model)
        return model, reference

    def build(self, model: torch.nn.Module, reference) -> None:
        """Take `model` as this expert's, with its frozen reference and a fresh optimizer."""
        if self.spec.parallel.activation_checkpointing:
            parallel.checkpoint_activations(model)
        self.model, self.reference = model, reference
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]  # all, or a LoRA adapter's
        self.optimizer = torch.optim.AdamW(self.trainable, lr=self.spec.lr)

    def join_gang(self, spec: GangSpec, rank: int) -> int:
        """Become rank `rank` of the expert's process group `spec` (leaving an older one). Under
        fsdp the model is sharded over it (built again from the config if it was sharded over an
        older group); a restore follows, so the state here may start over."""
        strategy = self.spec.parallel.strategy
        parallel.join(spec, rank)
        if strategy == "fsdp":
            model, reference = self.fresh(torch.device("cpu")) if self.gang else (self.model.cpu(), self.reference)
            if not is_lora(model):  # the frozen copy is sharded too
                parallel.shard(reference, self.device)
            self.build(parallel.shard(model, self.device, self.spec.parallel.reshard_after_forward,
                                      precision.fsdp_policy(self.computed)), reference)
        self.gang = Gang(rank, spec.ranks, strategy, spec.generation)
        return spec.generation

    @property
    def sharded(self) -> bool:
        """Whether this process holds shards of the expert (fsdp), not all of it."""
        return self.gang is not None and self.gang.strategy == "fsdp"

    def gang_generation(self) -> int | None:
        """The generation of the process group this process is in: None in a new (restarted) process."""
        return self.gang.generation if self.gang else None

    def weights(self) -> dict[str, np.ndarray] | None:
        """This version's weights as numpy arrays (experts/weights.py), whole; None on a rank
        other than the leader (which still takes part in gathering them)."""
        leader = self.gang is None or self.gang.leader
        state = parallel.gathered(self.model, synced_state(self.model), by_unit=not self.computed, keep=leader) \
            if self.sharded else synced_state(self.model)
        return arrays_of(state, self.private) if leader else None

    def info(self) -> ExpertInfo:
        return ExpertInfo(self.version, self.last_step)

    @contextmanager
    def among_peers(self, what: str):
        """Say a collective that failed because a peer is gone as GangBroken."""
        try:
            yield
        except RuntimeError as e:
            if self.gang and not isinstance(e, StaleExpert) and parallel.peer_lost(e):
                raise GangBroken(f"{self.expert_id} rank {self.gang.rank}: {what} lost a peer ({e})") from e
            raise

    def snapshot(self, with_optimizer: bool = True, with_weights: bool = True) -> Snapshot:
        """Everything that restores this expert exactly, with the weights' fingerprint (every worker
        checks it); every array in it on the host, wherever the model lives. `with_optimizer`=False
        leaves the optimizer state out (None): the weights and info of a version, to publish;
        `with_weights`=False the weights too (and their fingerprint): a version's info alone."""
        with self.among_peers("a snapshot"):
            weights = self.weights() if with_weights else None
        optimizer = None if not with_optimizer else parallel.optimizer_shard(self.optimizer, self.gang) \
            if self.sharded else optimizer_arrays(self.optimizer.state_dict(), self.private)
        if self.gang is not None and not self.gang.leader:
            return Snapshot(None, optimizer if self.sharded else None, self.info())
        return Snapshot(weights, optimizer, ExpertInfo(self.version, self.last_step,
                                                       None if weights is None else fingerprint(weights)))

    def restore(self, weights: dict, optimizer: dict | OptimizerShard | None, info: ExpertInfo) -> ExpertInfo:
        """Back to a snapshot or checkpoint: weights, optimizer moments (whole, or this rank's shard
        of a snapshot; as arrays or tensors; None: the optimizer state stays as it is), version and
        last applied step. The frozen reference is rebuilt from the config, as it was at the start."""
        tensors = model_tensors(self.model, weights)
        load(self.model, parallel.sharded_like(tensors, synced_state(self.model)) if self.sharded else tensors)
        if isinstance(optimizer, OptimizerShard):
            if not self.sharded or (optimizer.rank, optimizer.ranks) != (self.gang.rank, self.gang.ranks):
                raise ValueError(f"{self.expert_id}: the optimizer shard of rank {optimizer.rank} of {optimizer.ranks} "
                                 f"restores only that rank of a sharded gang of that size")
            self.optimizer.load_state_dict(parallel.from_shard(optimizer, self.trainable))
        elif optimizer is not None:
            state = optimizer_tensors(optimizer)
            self.optimizer.load_state_dict(parallel.sharded_optimizer_state(state, self.trainable)
                                           if self.sharded else state)
        self.version, self.last_step, self.last_stats = info.version, info.last_step, {}
        return self.info()

    def state_bytes(self) -> dict[str, int]:
        """Bytes this process holds of the expert's parameters, gradients and optimizer state (its
        shards of them under fsdp)."""
        return parallel.held_bytes(self.model, self.optimizer)

    def optimizer_files(self, into: str | None = None) -> ShardFiles:
        """This rank's shards of the optimizer state as checkpoint files (a collective: every rank
        of a sharded expert calls it), with the optimizer's hyper-parameters: written into `into`
        (the checkpoint's folder of them, where this process can reach it) or else handed over
        (`state_file.write_shards`)."""
        with self.among_peers("a checkpoint"):
            files = state_file.write_shards(self.optimizer, None if into is None else Path(into),
                                            self.config.cluster.temp_dir)
            return ShardFiles(files, self.optimizer.state_dict()["param_groups"])

    def update(self, step: int, version: int, advantages: np.ndarray, *shards: dict) -> dict:
        """One optimizer step on this step's samples, from `version` (the one the driver published);
        a repeated call for the same step is a no-op. An expert at another version refuses."""
        if step <= self.last_step:
            return self.last_stats
        if version != self.version:
            raise StaleExpert(f"{self.expert_id} is at version {self.version}, asked to update from {version}")
        with self.among_peers(f"step {step}'s update"):
            stats = self.apply(step, advantages, shards)
        self.version += 1
        self.last_step = step
        self.last_stats = {**stats, "version": self.version}
        return self.last_stats

    def apply(self, step: int, advantages: np.ndarray, shards: tuple[dict, ...]) -> dict:
        """The optimizer step itself: the kind's loss on the shards, its gradient, one clipped step;
        its stats, with `grad_norm`, the norm of the whole gradient before clipping (micro-batches
        add up to one gradient and one optimizer step: one norm per update). A non-finite loss leaves
        the weights as they were. In a gang each rank takes its share of the samples; their gradients
        and stats are summed across ranks. The gradients are freed once applied."""
        adv = torch.tensor(np.asarray(advantages), dtype=torch.float32, device=self.device)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        rows = self.gang.rows(len(adv)) if self.gang else None
        pad_to = self.gang.largest_share(len(adv)) if self.sharded else None  # the same collectives on every rank
        batch = self.kind.merge(self.model, list(shards), self.device)
        if self.sharded and self.spec.parallel.defer_gradient_sync:
            with parallel.gathered_through_update(self.model, self.reference,
                                                  self.spec.parallel.reshard_after_forward) as before_last:
                loss, stats = self.kind.backward(self.model, self.reference, batch, adv, rows=rows,
                                                 before_last=before_last, pad_to=pad_to)
        else:
            with precision.computed_in(self.model, {} if self.sharded else self.computed):
                loss, stats = self.kind.backward(self.model, self.reference, batch, adv, rows=rows, pad_to=pad_to)
        if self.gang:
            loss, stats = parallel.sum_stats(loss, stats, self.device)
            if self.gang.strategy == "ddp":
                parallel.sum_gradients(self.trainable)
        if not math.isfinite(loss):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"{self.expert_id}: non-finite loss at step {step}; update not applied")
        norm = torch.nn.utils.clip_grad_norm_(self.trainable, self.config.algorithm.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # not held through the next rollout (a colocated rank's)
        return {"loss": loss, **stats, "grad_norm": parallel.whole_norm(norm)}
