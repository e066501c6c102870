"""`ExpertActor`: one expert (a refiner or the generator) with its weights, reference and version.

Its version is 0 at start and +1 per applied update; `update` is idempotent by step, so a retried
call never applies an update twice. Weights leave the actor as a dict of numpy arrays, which Ray's
object store hands to rollout workers without copying.
"""
from __future__ import annotations

import copy

import numpy as np
import torch

from cluster.collective import BroadcastMember
from cluster.recovery import in_ray_actor, this_node
from cluster.weight_sync import fingerprint
from experts.build import build_model
from experts.devices import actor_device, to_device
from experts.updates import generator_loss, refiner_loss
from experts.weights import load, model_tensors, reference_of, synced_state, to_arrays, travel_form


def _tensor(x) -> torch.Tensor:
    return torch.tensor(np.asarray(x))


def merge_refiner_batches(expert_id: str, shards: list[dict]) -> dict:
    """This refiner's samples from every rollout shard, in shard order."""
    parts = [s[expert_id] for s in shards if expert_id in s and len(s[expert_id]["prompts"])]
    return {"prompts": [p for s in parts for p in s["prompts"]],
            **{k: torch.cat([_tensor(s[k]) for s in parts]) for k in ("tokens", "logps", "mask")}}


def merge_generator_batches(model, shards: list[dict]) -> dict:
    """All trajectories from every rollout shard, their conditioning joined as the model needs it
    (the tiny DiT re-pads its text features to a common length)."""
    return {"states": torch.cat([_tensor(s["states"]) for s in shards]),
            "logps": torch.cat([_tensor(s["logps"]) for s in shards]),
            "cond": model.merge_conditions([{k: _tensor(v) for k, v in s["cond"].items()} for s in shards]),
            "sigmas": _tensor(shards[0]["sigmas"]), "sde": _tensor(shards[0]["sde"])}


class StaleExpert(RuntimeError):
    """An expert asked to update from a version it does not hold (it restarted and lost its state)."""


class ExpertActor(BroadcastMember):
    def __init__(self, config, expert_id: str):
        torch.set_num_threads(1)
        self.expert_id, self.config = expert_id, config
        self.spec = config.expert(expert_id)
        self.device = actor_device(self.spec.resources)
        self.model = build_model(config, expert_id).to(self.device)
        self.reference = reference_of(self.model)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]  # all, or a LoRA adapter's
        self.optimizer = torch.optim.AdamW(self.trainable, lr=self.spec.lr)
        self.version = 0
        self.last_step, self.last_stats = -1, {}

    def weights(self) -> dict[str, np.ndarray]:
        """This version's weights as numpy arrays (experts/weights.py). In a Ray actor they are views:
        Ray copies them into the object store as the method returns, once. In-process (inline) they
        are copied here, or a later update would change a snapshot already taken."""
        return to_arrays(self.model, private=not in_ray_actor())

    def send_weights(self, version: int) -> None:
        """Broadcast this expert's weights, at `version`, into every rollout worker (`cluster.sync=collective`)."""
        if version != self.version:
            raise StaleExpert(f"{self.expert_id} is at version {self.version}, asked to send version {version}")
        self.broadcast_group.send(self.expert_id, travel_form(synced_state(self.model)))

    def node(self) -> str | None:
        """The Ray node this expert runs on now (it may move when Ray restarts it)."""
        return this_node()

    def info(self) -> dict:
        return {"version": self.version, "last_step": self.last_step}

    def snapshot(self) -> tuple[dict, dict, dict]:
        """Everything that restores this expert exactly, as three objects: (weights, optimizer
        state, {version, last_step, checksum: the weights' fingerprint, checked by every worker}). The driver keeps the latest as ObjectRefs (it owns them, so
        they outlive this actor), publishes the weights alone, fetches only the small third one,
        and checkpoints all three."""
        weights = self.weights()
        optimizer = self.optimizer.state_dict()
        return (weights, optimizer if in_ray_actor() else copy.deepcopy(optimizer),
                {**self.info(), "checksum": fingerprint(weights)})

    def restore(self, weights: dict, optimizer: dict | None, info: dict) -> dict:
        """Back to a snapshot or checkpoint: weights, optimizer moments, version and last applied
        step. The frozen reference is rebuilt from the config, as it was at the start."""
        load(self.model, model_tensors(self.model, weights))
        if optimizer is not None:
            self.optimizer.load_state_dict(optimizer)
        self.version, self.last_step, self.last_stats = info["version"], info["last_step"], {}
        return self.info()

    def update(self, step: int, version: int, advantages: np.ndarray, *shards: dict) -> dict:
        """One optimizer step on this step's samples, from `version` (the one the driver published);
        a repeated call for the same step is a no-op. An expert at another version (a restarted
        instance, back at 0) refuses, so the driver restores it first: never a silent reset."""
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
        """The optimizer step itself: this expert's loss on the shards, one clipped step; its stats."""
        adv = torch.tensor(np.asarray(advantages), dtype=torch.float32, device=self.device)
        self.model.train()
        if self.expert_id == "generator":
            batch = to_device(merge_generator_batches(self.model, list(shards)), self.device)
            loss, stats = generator_loss(self.model, self.reference, batch, adv, self.spec.noise_level,
                                         self.spec.clip_eps, self.spec.kl_beta)
        else:
            batch = to_device(merge_refiner_batches(self.expert_id, list(shards)), self.device)
            loss, stats = refiner_loss(self.model, self.reference, batch, adv, self.spec.clip_eps,
                                         self.spec.kl_beta)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"{self.expert_id}: non-finite loss at step {step}; update not applied")
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.trainable, self.config.algorithm.grad_clip)
        self.optimizer.step()
        return {"loss": float(loss.detach()), **stats}
