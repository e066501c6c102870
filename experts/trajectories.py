"""A rollout shard's trajectories as they travel to the generator's update: what Flow-GRPO's loss
reads of them (algorithm/losses.py), and nothing more.

The loss re-evaluates each trained SDE transition x_t -> x_{t+1}: it reads those two states, the
log-prob recorded at rollout, the sigmas and each sample's text conditioning. So a trajectory keeps
the states of the trained transitions only (not those of ODE steps outside `sde_window`), the
empty prompt's conditioning of classifier-free guidance once (not once per sample), and text
features in the dtype the text encoders made them in. numpy has no bfloat16: a bfloat16 feature
travels as its raw 16-bit words, as weights do (experts/weights.py), and `dtypes` says what each
feature is.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from experts.flow_family import NEGATIVE
from experts.weights import as_tensor, travel_form


class Trajectories(NamedTuple):
    """One shard's trajectories (B samples, T steps): `states` (B, S, *latent) float32, the states
    x_t at the steps `state_steps` (S,), which are t and t + 1 of every trained transition;
    `logps` (B, T) float32, log pi(x_{t+1} | x_t) at rollout (0 at ODE steps); `cond`, each
    sample's conditioning ({name: (B, ...)}); `shared_cond`, what every sample shares
    ({"negative_<name>": (1, ...)}, the empty prompt's under guidance; {} without); `dtypes`, the
    torch dtype of every entry of both; `sigmas` (T+1,) float32; `sde` (T,) bool, the SDE steps."""
    states: np.ndarray
    state_steps: np.ndarray
    logps: np.ndarray
    cond: dict[str, np.ndarray]
    shared_cond: dict[str, np.ndarray]
    dtypes: dict[str, str]
    sigmas: np.ndarray
    sde: np.ndarray


def split_shared(cond: dict) -> tuple[dict, dict]:
    """(each sample's conditioning, the conditioning every sample shares: the empty prompt's one
    row under guidance), of a front end's `condition`."""
    return ({k: v for k, v in cond.items() if not k.startswith(NEGATIVE)},
            {k: v for k, v in cond.items() if k.startswith(NEGATIVE)})


def host_arrays(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(the tensors as numpy arrays on the host, bfloat16 as raw words; each one's torch dtype)."""
    arrays = {k: v.cpu().numpy() for k, v in travel_form(tensors).items()}
    return arrays, {k: str(v.dtype).removeprefix("torch.") for k, v in tensors.items()}


def device_tensors(arrays: dict[str, np.ndarray], dtypes: dict[str, str]) -> dict[str, torch.Tensor]:
    """`host_arrays`' arrays as tensors of their dtypes again (uncopied where they can be)."""
    tensors = {k: as_tensor(v) for k, v in arrays.items()}
    return {k: v.view(torch.bfloat16) if dtypes[k] == "bfloat16" else v for k, v in tensors.items()}


def trajectories(states: torch.Tensor, state_steps: torch.Tensor, logps: torch.Tensor, cond: dict, *, shared_cond: dict,
                 sigmas: torch.Tensor, sde: torch.Tensor) -> Trajectories:
    """The travelling form of a shard's trajectories, from tensors on any device."""
    cond_arrays, cond_dtypes = host_arrays(cond)
    shared_arrays, shared_dtypes = host_arrays(shared_cond)
    return Trajectories(states.cpu().numpy(), state_steps.cpu().numpy(), logps.cpu().numpy(), cond_arrays,
                        shared_arrays, {**cond_dtypes, **shared_dtypes}, sigmas.cpu().numpy(), sde.cpu().numpy())
