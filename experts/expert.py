"""`Expert`: one expert's trainable state (model, frozen reference, optimizer) and its version.

Its version is 0 at start and +1 per applied update. `update` is idempotent by step, so a retried
call never applies an update twice, and refuses to start from a version it does not hold, so a
restarted instance is restored first instead of silently starting over. What the update computes
(model, batch merging, loss) is the expert's kind's (experts/kinds.py).
"""
from __future__ import annotations

import copy
import math

import numpy as np
import torch

from experts.kinds import expert_kind
from experts.records import ExpertInfo, Snapshot
from experts.weights import fingerprint, load, model_tensors, reference_of, to_arrays


class StaleExpert(RuntimeError):
    """An expert asked to update from a version it does not hold (it restarted and lost its state)."""


class Expert:
    def __init__(self, config, expert_id: str, device: torch.device = torch.device("cpu"), private: bool = True):
        """`private`: weights and snapshots leave as copies that a later update cannot change
        (False: as views of the model's tensors, for a caller that copies them out at once)."""
        self.expert_id, self.config, self.device, self.private = expert_id, config, device, private
        self.kind = expert_kind(config, expert_id)
        self.spec = self.kind.spec
        self.model = self.kind.build_model().to(device)
        self.reference = reference_of(self.model)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]  # all, or a LoRA adapter's
        self.optimizer = torch.optim.AdamW(self.trainable, lr=self.spec.lr)
        self.version = 0
        self.last_step, self.last_stats = -1, {}

    def weights(self) -> dict[str, np.ndarray]:
        """This version's weights as numpy arrays (experts/weights.py)."""
        return to_arrays(self.model, private=self.private)

    def info(self) -> ExpertInfo:
        return ExpertInfo(self.version, self.last_step)

    def snapshot(self) -> Snapshot:
        """Everything that restores this expert exactly, with the weights' fingerprint (every worker
        checks it)."""
        weights = self.weights()
        optimizer = self.optimizer.state_dict()
        return Snapshot(weights, copy.deepcopy(optimizer) if self.private else optimizer,
                        ExpertInfo(self.version, self.last_step, fingerprint(weights)))

    def restore(self, weights: dict, optimizer: dict | None, info: ExpertInfo) -> ExpertInfo:
        """Back to a snapshot or checkpoint: weights, optimizer moments, version and last applied
        step. The frozen reference is rebuilt from the config, as it was at the start."""
        load(self.model, model_tensors(self.model, weights))
        if optimizer is not None:
            self.optimizer.load_state_dict(optimizer)
        self.version, self.last_step, self.last_stats = info.version, info.last_step, {}
        return self.info()

    def update(self, step: int, version: int, advantages: np.ndarray, *shards: dict) -> dict:
        """One optimizer step on this step's samples, from `version` (the one the driver published);
        a repeated call for the same step is a no-op. An expert at another version refuses."""
        if step <= self.last_step:
            return self.last_stats
        if version != self.version:
            raise StaleExpert(f"{self.expert_id} is at version {self.version}, asked to update from {version}")
        stats = self.apply(step, advantages, shards)
        self.version += 1
        self.last_step = step
        self.last_stats = {**stats, "version": self.version}
        return self.last_stats

    def apply(self, step: int, advantages: np.ndarray, shards: tuple[dict, ...]) -> dict:
        """The optimizer step itself: the kind's loss on the shards, its gradient, one clipped step;
        its stats. A non-finite loss leaves the weights as they were."""
        adv = torch.tensor(np.asarray(advantages), dtype=torch.float32, device=self.device)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss, stats = self.kind.backward(self.model, self.reference,
                                         self.kind.merge(self.model, list(shards), self.device), adv)
        if not math.isfinite(loss):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"{self.expert_id}: non-finite loss at step {step}; update not applied")
        torch.nn.utils.clip_grad_norm_(self.trainable, self.config.algorithm.grad_clip)
        self.optimizer.step()
        return {"loss": loss, **stats}
