"""Checkpoints: everything needed to resume a run exactly, and nothing loaded through pickle.

`checkpoints/step_N/` holds, per expert, its state file (`experts.state_file`: weights and
optimizer in safetensors, version and last applied step in JSON), plus `manifest.json` (the
step the driver resumes at, every expert's version, and a sha256 per file). An asynchronous run
(`cluster.max_staleness` > 0) also keeps the older weights its rollouts in flight were made with,
as `<id>.v<version>` files, and which step used which. Random draws need no
saved state: each one derives from (trainer.seed, step, sample). A checkpoint is written into a
temporary folder and renamed into place, so it is whole or absent; the last
`trainer.keep_checkpoints` are kept.
"""
from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from cluster.runtime import get
from common.config import SettingError
from experts import state_file
from experts.records import ExpertInfo, ShardFiles, Snapshot
from experts.weights import synced_state


class CheckpointError(SettingError):
    """A checkpoint that is missing, corrupt or made for another config; the CLI exits with 2."""


def fresh_temporary(final: Path) -> Path:
    """`final`'s temporary folder beside it, emptied and made afresh."""
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


@contextmanager
def atomic_dir(final: Path, staged: bool = False):
    """Yield a temporary folder beside `final` (made afresh, or as `staging` made it already and
    filled in part: `staged`); once the block succeeds it replaces `final`."""
    tmp = final.with_name(final.name + ".tmp") if staged else fresh_temporary(final)
    try:
        yield tmp
    except BaseException:  # a full disk, an interrupt: no half-written folder is left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)


def staging(run_dir: Path, step: int) -> Path:
    """Checkpoint `step`'s temporary folder, made afresh, for the ranks of sharded experts to write
    their optimizer shards into before `save(..., staged=True)` writes the rest and renames it."""
    return fresh_temporary(checkpoint_path(run_dir, step))


def save(run_dir: Path, step: int, snapshots: dict[str, Snapshot], keep: int = 0,
         *, in_flight: dict[int, dict[str, tuple]] | None = None, staged: bool = False) -> Path:
    """Write checkpoint `step` (the driver resumes at this step) from each expert's snapshot and
    the rollouts in flight's older weights ({step: {expert: (version, weights)}}), into the
    temporary folder `staging` made if `staged`, else into a fresh one; prune to the last `keep`.
    Each file is hashed as it is written (`state_file.write`), none is read back."""
    final = checkpoint_path(run_dir, step)
    in_flight = in_flight or {}
    with atomic_dir(final, staged) as tmp:
        files = {}
        for eid, snapshot in snapshots.items():
            files.update(state_file.write(tmp, eid, snapshot.weights, snapshot.optimizer, info=snapshot.info))
        for older in in_flight.values():
            for eid, (version, weights) in older.items():
                if f"{eid}.v{version}.safetensors" not in files:
                    info = ExpertInfo(version, -1)
                    files.update(state_file.write(tmp, f"{eid}.v{version}", weights, None, info=info))
        (tmp / "manifest.json").write_text(json.dumps(
            {"step": step, "versions": {e: s.info.version for e, s in snapshots.items()},
             "in_flight": {str(s): {e: v for e, (v, _) in older.items()} for s, older in in_flight.items()},
             "files": dict(sorted(files.items()))}, indent=1))
    if keep:
        for old in all_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old)
    return final


def save_fetched(run_dir: Path, step: int, snapshots: dict[str, Snapshot], keep: int = 0,
                 *, in_flight: dict[int, dict[str, tuple]] | None = None, staged: bool = False) -> Path:
    """`save`, given its arrays as ObjectRefs: each expert's snapshot (a sharded expert's optimizer
    as its ranks' ShardFiles) and the in-flight weights, fetched here. The driver has this run on
    its node as a task of its own (the run directory is the one the user named), so it forwards
    references and never deserializes what they hold. Arrays come out of the object store as
    views of it, and are written from there."""
    fetched = {}
    for eid, snapshot in snapshots.items():
        optimizer = snapshot.optimizer
        if isinstance(optimizer, list):  # every rank's ShardFiles, as one
            parts = [ShardFiles(*get([part.files, part.param_groups])) for part in optimizer]
            optimizer = ShardFiles({name: held for part in parts for name, held in part.files.items()},
                                   parts[0].param_groups)
        else:
            optimizer = get(optimizer)
        fetched[eid] = Snapshot(get(snapshot.weights), optimizer, get(snapshot.info))
    older = {s: {eid: (version, get(weights)) for eid, (version, weights) in entries.items()}
             for s, entries in (in_flight or {}).items()}
    return save(run_dir, step, fetched, keep, in_flight=older, staged=staged)


def checkpoint_path(run_dir: Path, step: int) -> Path:
    """The folder of the checkpoint a run resumes at `step` from."""
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def checkpoint_exists(run_dir: Path, step: int) -> bool:
    return (checkpoint_path(run_dir, step) / "manifest.json").is_file()


def step_of(ckpt: Path) -> int:
    """The step a checkpoint folder resumes at (its name is `step_N`, as `save` writes it)."""
    return int(ckpt.name.split("_")[1])


def all_checkpoints(run_dir: Path) -> list[Path]:
    return sorted(p for p in (run_dir / "checkpoints").glob("step_*[0-9]") if p.is_dir())


def latest(run_dir: Path) -> Path:
    found = all_checkpoints(run_dir)
    if not found:
        raise CheckpointError(f"'{run_dir}' has no checkpoints (expected {run_dir}/checkpoints/step_N/)")
    return found[-1]


def manifest(ckpt: Path) -> dict:
    """The manifest of `ckpt`, after checking every file it lists against its hash."""
    try:
        info = json.loads((ckpt / "manifest.json").read_text())
        files = info["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint '{ckpt}' has no readable manifest.json ({e}); it is incomplete "
                              f"or from an older jointrl. Nothing was started.") from None
    for name, digest in files.items():
        path = ckpt / name
        if not path.is_file() or state_file.sha256(path) != digest:
            raise CheckpointError(f"checkpoint file '{path}' is {'missing' if not path.is_file() else 'corrupt'} "
                                  f"(its sha256 does not match manifest.json). Nothing was started; resume "
                                  f"from an earlier checkpoint by removing this one.")
    return info


def verify(ckpt: Path, expert_ids: list[str]) -> int:
    """The step `ckpt` resumes at, once its files match their hashes and it holds `expert_ids`."""
    info = manifest(ckpt)
    missing = [e for e in expert_ids if f"{e}.safetensors" not in info["files"]]
    extra = sorted(set(info["versions"]) - set(expert_ids))
    if missing or extra:
        raise CheckpointError(f"checkpoint '{ckpt}' holds experts {sorted(info['versions'])}, but the config has "
                              f"{expert_ids} (missing {missing}, unexpected {extra}): it is from another config. "
                              f"Nothing was started.")
    return info["step"]


def load(ckpt: Path, expert_ids: list[str]) -> tuple[int, dict[str, Snapshot]]:
    """(the step to resume at, each expert's snapshot) from a verified checkpoint."""
    return verify(ckpt, expert_ids), {e: state_file.read(ckpt, e) for e in expert_ids}


def load_in_flight(ckpt: Path) -> dict[int, dict[str, tuple]]:
    """{step: {expert: (version, weights)}}: the older weights each rollout in flight was made with."""
    return {int(s): {e: (v, state_file.read(ckpt, f"{e}.v{v}").weights) for e, v in older.items()}
            for s, older in manifest(ckpt).get("in_flight", {}).items()}


def latest_weights(run_dir: Path, expert_ids: list[str]) -> tuple[Path, dict[str, dict]]:
    """(the latest verified checkpoint of `run_dir`, each expert's weights as numpy arrays)."""
    ckpt = latest(run_dir)
    verify(ckpt, expert_ids)
    return ckpt, {e: {k: v.numpy() for k, v in state_file.read_weights(ckpt / f"{e}.safetensors").items()}
                  for e in expert_ids}


def pipeline_at(run_dir: Path, config) -> tuple[Path, "RolloutPipeline"]:
    """(the latest verified checkpoint of `run_dir`, a rollout pipeline serving its weights): what
    `jointrl eval`, `sample` and `report` draw with."""
    from experts.devices import local_device
    from experts.pipeline import RolloutPipeline
    from experts.weights import model_tensors
    ckpt, weights = latest_weights(run_dir, config.experts.ids())
    torch.set_num_threads(1)
    pipeline = RolloutPipeline(config, device=local_device())
    for eid, state in weights.items():
        pipeline.load(eid, step_of(ckpt), model_tensors(pipeline.models[eid], state))
    return ckpt, pipeline


def check_shapes(ckpt: Path, expert_id: str, model: torch.nn.Module) -> None:
    """Raise, naming the tensor, if `ckpt`'s weights for `expert_id` do not fit `model`."""
    path = ckpt / f"{expert_id}.safetensors"
    want = {f"weights.{k}": tuple(v.shape) for k, v in synced_state(model).items()}
    try:
        with safe_open(str(path), "pt") as f:
            have = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys() if k.startswith("weights.")}
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"checkpoint file '{path}' is not readable safetensors ({e})") from None
    for key in sorted(set(want) | set(have)):
        if want.get(key) != have.get(key):
            raise CheckpointError(f"checkpoint '{path}' does not fit the config's {expert_id}: '{key[8:]}' has shape "
                                  f"{have.get(key)} there and {want.get(key)} in the model (another model shape "
                                  f"or N). Nothing was started.")
