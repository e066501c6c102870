"""Checkpoint files written as they stream: byte for byte what safetensors' own writer writes,
hashed as written, no copy of the snapshot in the writer, a sharded optimizer's files written by
its ranks where the writer is, and a local Ray's session and spill folders where the config says."""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from experts import state_file
from experts.records import ExpertInfo, ShardFiles, Snapshot

ROOT = Path(__file__).resolve().parent.parent


def test_a_file_is_byte_for_byte_what_safetensors_writes_and_its_hash_is_the_files(tmp_path):
    """Torch tensors of every kind a snapshot holds (bfloat16, a 0-d step count, an empty tensor,
    integers, booleans) and numpy arrays (big-endian, non-contiguous) against safetensors.torch.save_file
    on the same tensors."""
    gen = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(3, 5, generator=gen), "moment": torch.randn(7, generator=gen).to(torch.bfloat16),
               "step": torch.tensor(3.0), "none": torch.zeros(0, 4), "ids": torch.arange(5), "mask": torch.ones(3, dtype=torch.bool),
               "half": torch.randn(2, 3, generator=gen).half()}
    arrays = {"big": np.arange(6, dtype=">f4").reshape(2, 3), "strided": np.arange(12.0).reshape(3, 4).T}
    mine = state_file.write_safetensors(tmp_path / "mine.safetensors", {**tensors, **arrays})
    as_torch = {k: torch.from_numpy(np.ascontiguousarray(v, dtype=v.dtype.newbyteorder("="))) for k, v in arrays.items()}
    save_file({**tensors, **as_torch}, str(tmp_path / "theirs.safetensors"))
    written = (tmp_path / "mine.safetensors").read_bytes()
    assert written == (tmp_path / "theirs.safetensors").read_bytes()
    assert mine == hashlib.sha256(written).hexdigest() == state_file.sha256(tmp_path / "mine.safetensors")


def test_an_unstorable_dtype_names_the_tensor(tmp_path):
    with pytest.raises(ValueError, match="cannot store 'z': safetensors has no dtype complex64"):
        state_file.write_safetensors(tmp_path / "x.safetensors", {"z": np.zeros(2, np.complex64)})


def test_a_checkpoints_manifest_lists_each_files_sha256(tmp_path):
    from driver import checkpoint
    snap = Snapshot({"w": np.ones((4, 4), np.float32)},
                    {"state": {0: {"step": np.asarray(np.float32(2)), "exp_avg": np.zeros((4, 4), np.float32)}},
                     "param_groups": [{"lr": 0.1, "params": [0]}], "bfloat16": []}, ExpertInfo(2, 1))
    ckpt = checkpoint.save(tmp_path, 2, {"generator": snap}, in_flight={1: {"generator": (1, {"w": np.zeros((4, 4), np.float32)})}})
    files = json.loads((ckpt / "manifest.json").read_text())["files"]
    on_disk = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file() and p.name != "manifest.json")
    assert sorted(files) == on_disk == ["generator.json", "generator.safetensors", "generator.v1.json",
                                        "generator.v1.safetensors"]
    assert all(hashlib.sha256((ckpt / f).read_bytes()).hexdigest() == digest for f, digest in files.items())
    assert checkpoint.verify(ckpt, ["generator"]) == 2


@pytest.mark.cluster  # it starts bench/checkpoint_writer.py in a process of its own
def test_the_writer_adds_no_copy_of_the_snapshot_it_writes():
    """A 144 MB expert file (a stand-in model's weights and Adam moments, numpy as they come from
    the object store), written by bench/checkpoint_writer.py's measure: what writing it adds to the
    writer's resident memory stays under a fifth of the file, the writer's whole under 1.2x it (the
    previous writer, safetensors' save_file on torch copies and a sha256 that read the file back,
    added 2.2x it)."""
    out = subprocess.run([sys.executable, "bench/checkpoint_writer.py", "--width", "2048", "--layers", "3", "--json"],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["largest"] > 144 << 20
    assert r["added"] < 0.2 * r["largest"] and r["ratio"] <= 1.2, r


def adam_after_one_step() -> torch.optim.Optimizer:
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3).to(torch.bfloat16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model[1](model[0](torch.randn(4, 6)).to(torch.bfloat16)).float().sum().backward()
    optimizer.step()
    return optimizer


@pytest.mark.parametrize("where", ["into the checkpoint", "handed over"])
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_sharded_optimizers_files_are_written_where_the_writer_is_or_handed_over(tmp_path, where):
    """A rank on the writer's node writes its shards straight into the checkpoint's folder and hands
    over their sha256; a rank elsewhere hands over the files' bytes, mapped from a scratch folder it
    then removes. Either way the checkpoint reads back the optimizer's state exactly."""
    from driver import checkpoint
    optimizer = adam_after_one_step()
    staging = checkpoint.staging(tmp_path, 1)
    into = staging / f"generator{state_file.SHARDS}" if where == "into the checkpoint" else None
    scratch = tmp_path / "scratch"
    files = state_file.write_shards(optimizer, into, str(scratch))
    if into is None:
        assert all(isinstance(v, np.ndarray) and v.dtype == np.uint8 for v in files.values())
        assert list(scratch.iterdir()) == []
    else:
        assert sorted(p.name for p in into.iterdir()) == sorted(files)  # no scratch left in the checkpoint
        assert all(files[name] == state_file.sha256(into / name) for name in files)
    groups = optimizer.state_dict()["param_groups"]
    ckpt = checkpoint.save(tmp_path, 1, {"generator": Snapshot({}, ShardFiles(files, groups), ExpertInfo(1, 0))},
                           staged=True)
    assert checkpoint.verify(ckpt, ["generator"]) == 1
    saved = state_file.read(ckpt, "generator").optimizer["state"]
    for pid, entries in optimizer.state_dict()["state"].items():
        for key, value in entries.items():
            assert torch.equal(saved[pid][key], value), (pid, key)


def test_a_rank_that_said_it_wrote_a_shard_which_is_not_there_is_named(tmp_path):
    from driver import checkpoint
    with pytest.raises(FileNotFoundError, match=r"generator\.optimizer/shard-1\.safetensors': a rank said it wrote it"):
        checkpoint.save(tmp_path, 1, {"generator": Snapshot({}, ShardFiles({"shard-1.safetensors": "0" * 64}, []),
                                                            ExpertInfo(1, 0))})
    assert not (tmp_path / "checkpoints" / "step_000001").exists()


LOCAL_RAY = r"""
import sys, ray, numpy as np
from pathlib import Path
from cluster.connect import local_folders
temp_dir, spill_dir = sys.argv[1], sys.argv[2]
ray.init(address="local", num_cpus=1, include_dashboard=False, object_store_memory=80 << 20,
         _node_ip_address="127.0.0.1", **local_folders(temp_dir, spill_dir))
held = [ray.put(np.full(6 << 20, i, np.float32)) for i in range(4)]  # 96 MB into an 80 MB store
spilled = [p for p in Path(spill_dir).rglob("*") if p.is_file()]
assert [int(ray.get(r)[0]) for r in held] == [0, 1, 2, 3]
print(len(spilled))
print(ray._private.worker._global_node.get_session_dir_path())
"""


@pytest.mark.cluster  # it starts a Ray of its own
def test_a_local_ray_keeps_its_session_and_spills_where_the_config_says(tmp_path):
    """cluster.temp_dir and cluster.spill_dir as a local Ray takes them: its session folder under
    the one (a short path: Ray's sockets live there), the objects its store cannot hold in the other."""
    short = Path(tempfile.mkdtemp(prefix="jr-", dir="/tmp"))
    try:
        temp_dir, spill_dir = short / "ray", tmp_path / "spill"
        out = subprocess.run([sys.executable, "-c", LOCAL_RAY, str(temp_dir), str(spill_dir)], cwd=ROOT,
                             env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
                             capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stderr[-2000:]
        spilled, session = out.stdout.strip().splitlines()[-2:]
        assert Path(session).parent == temp_dir.resolve()
        assert int(spilled) > 0, "nothing was spilled into cluster.spill_dir"
    finally:
        shutil.rmtree(short, ignore_errors=True)


def test_a_temp_dir_too_long_for_rays_sockets_is_refused_at_config_time():
    from common.config import SettingError
    from driver.preflight import load_config
    with pytest.raises(SettingError, match=r"cluster\.temp_dir='/tmp/x{60}' .* is too long: Ray's sockets"):
        load_config("shapes-tiny", [f"cluster.temp_dir=/tmp/{'x' * 60}"])
    assert load_config("shapes-tiny", ["cluster.temp_dir=/scratch/ray"]).cluster.temp_dir == "/scratch/ray"
