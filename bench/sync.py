"""Weight sync and rollout-worker memory, measured side by side in one run on local Ray.

sync:   time to deliver a generator of ~S MB to W rollout workers. jointrl's path: a fingerprint,
        one `ray.put`, the sync actor hands the ref to every worker, each worker checks the
        fingerprint and maps the weights read-only from the object store (`cluster.share_weights`),
        then acknowledges. Against the memcpy bound measured in the same run, (W+1)*S / memcpy
        bandwidth, and against naive transfer: the torch state dict passed to each worker's call
        (serialised once per worker) and copied into its model. And the collective path
        (`cluster.sync=collective`, gloo between CPU processes here, NCCL between GPUs): the expert
        broadcasts its weights into every worker, which checks the fingerprint.
memory: what W workers holding the generator add to the machine (their private memory plus the
        object-store copy they map) against W private copies (`cluster.share_weights=false`).
Prints a table and writes bench/results/sync.md (`make bench-sync`; `make bench` prints it in perf.md).
Usage: python bench/sync.py [--sizes 10 100 400] [--workers 1 2 4] [--repeats 5] [--quick]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402

from cluster.expert_actor import ExpertActor  # noqa: E402
from cluster.rollout_worker import RolloutWorker  # noqa: E402
from cluster.runtime import Runtime, get  # noqa: E402
from cluster.weight_sync import WeightSyncActor  # noqa: E402
from driver.preflight import load_config  # noqa: E402
from experts.kinds import build_model  # noqa: E402
from experts.records import Release  # noqa: E402
from experts.weights import fingerprint  # noqa: E402

MB = 1 << 20


class NaiveWorker(RolloutWorker):
    """A rollout worker that also takes a torch state dict by value, as a naive sync would send it."""

    def load_torch(self, expert_id: str, state: dict) -> int:
        self.models[expert_id].load_state_dict(state)
        return 0


def generator_config(megabytes: float, share: bool):
    """The shapes config with its generator widened to about `megabytes` of float32 weights."""
    for d_model in range(64, 8192, 64):
        cfg = load_config("shapes-tiny", [f"experts.generator.model.d_model={d_model}",
                                          f"cluster.share_weights={str(share).lower()}"])
        with torch.device("meta"):
            size = sum(p.numel() * 4 for p in build_model(cfg, "generator", fresh=True).parameters())
        if size >= megabytes * MB:
            return cfg, size
    raise ValueError(f"no generator of {megabytes} MB")


def memcpy_bandwidth(nbytes: int) -> float:
    """Bytes per second of a warm copy of `nbytes` in this process (best of 5)."""
    src, dst = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
    np.copyto(dst, src)
    best = min(timed(lambda: np.copyto(dst, src)) for _ in range(5))
    return nbytes / best


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def private_kib(pid: int) -> int:
    """Private (unshared) resident memory of a process: what it alone adds to the machine."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:])
    return sum(int(fields[k].split()[0]) for k in ("Private_Clean", "Private_Dirty"))


def spawn_workers(runtime: Runtime, cfg, n: int, cls=RolloutWorker) -> tuple[list, list[str]]:
    """`n` rollout workers named as a run names them (the weight-sync actor finds them by name)."""
    names = [f"rollout/{j}" for j in range(n)]
    return [runtime.spawn(cls, cfg, j, name=name) for j, name in enumerate(names)], names


def sync_row(megabytes: float, workers: int, repeats: int, bandwidth: float) -> dict:
    cfg, size = generator_config(megabytes, share=True)
    model = build_model(cfg, "generator", fresh=True)
    weights = {k: v.numpy() for k, v in model.state_dict().items()}
    runtime = Runtime("ray", f"bench-sync-{time.time_ns()}")
    pool, names = spawn_workers(runtime, cfg, workers, NaiveWorker)
    expert = runtime.spawn(ExpertActor, cfg, "generator", name="expert/generator")
    sync = runtime.spawn(WeightSyncActor, runtime.members, names, name="weight_sync")
    broadcaster = runtime.spawn(WeightSyncActor, runtime.members, names, ["generator"],
                                {"backend": "gloo", "timeout_s": 60.0}, name="broadcaster")
    expert_sum = get(expert.snapshot.options(num_returns=3).remote()[2]).checksum
    get([w.version_vector.remote() for w in pool])

    def jointrl(version):
        def deliver():
            ref = ray.put(weights)
            get(sync.publish.remote({"generator": Release(version, ref, fingerprint(weights))}))
        return deliver

    def collective():
        get(broadcaster.publish.remote({"generator": Release(0, None, expert_sum)}, broadcast=True))

    def naive():
        state = model.state_dict()
        get([w.load_torch.remote("generator", state) for w in pool])
    # two versions are alive at once (the one workers still map, the new one): the first two puts
    # touch fresh object-store pages, later ones reuse them, as a run's steady state does
    ours = [timed(jointrl(v)) for v in range(repeats + 2)][2:]
    theirs = [timed(naive) for _ in range(repeats + 1)][1:]
    broadcast = [timed(collective) for _ in range(repeats + 1)][1:]  # the first forms the group
    assert get(broadcaster.registrations.remote()) == {"generator": 0}
    for handle in (*pool, sync, broadcaster, expert):
        ray.kill(handle)
    bound = (workers + 1) * size / bandwidth
    ours_s, theirs_s, broadcast_s = statistics.median(ours), statistics.median(theirs), statistics.median(broadcast)
    return {"MB": size / MB, "W": workers, "jointrl_ms": ours_s * 1e3, "bound_ms": bound * 1e3,
            "vs_bound": ours_s / bound, "naive_ms": theirs_s * 1e3, "speedup": theirs_s / ours_s,
            "collective_ms": broadcast_s * 1e3}


def memory_row(megabytes: float, workers: int) -> dict:
    """Machine memory W workers add for the generator, shared and private, against one copy."""
    out = {}
    for share in (True, False):
        cfg, size = generator_config(megabytes, share)
        small_cfg, _ = generator_config(0, share)
        totals = {}
        for name, c in (("big", cfg), ("small", small_cfg)):
            runtime = Runtime("ray", f"bench-memory-{time.time_ns()}")
            pool, names = spawn_workers(runtime, c, workers)
            sync = runtime.spawn(WeightSyncActor, runtime.members, names, name="weight_sync")
            weights = {k: v.numpy() for k, v in build_model(c, "generator", fresh=True).state_dict().items()}
            ref = ray.put(weights)
            get(sync.publish.remote({"generator": Release(1, ref, fingerprint(weights))}))
            pids = get([w.__ray_call__.remote(lambda self: __import__("os").getpid()) for w in pool])
            totals[name] = sum(private_kib(p) for p in pids) * 1024
            for handle in (*pool, sync):
                ray.kill(handle)
            del ref
        mapped = size if share else 0  # the object-store copy shared workers read from
        out["shared" if share else "private"] = (totals["big"] - totals["small"] + mapped) / size
        out["MB"] = size / MB
    return {"W": workers, **out}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=float, nargs="+", default=[10, 100, 400])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="10 MB to 1 and 2 workers, 2 repeats (a smoke run)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "sync.md"))
    args = p.parse_args()
    if args.quick:
        args.sizes, args.workers, args.repeats = [10], [1, 2], 2
    torch.set_num_threads(1)
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             object_store_memory=max(int(max(args.sizes) * MB * (max(args.workers) + 4)), 512 * MB))
    try:
        bandwidth = memcpy_bandwidth(int(max(args.sizes) * MB))
        rows = [sync_row(s, w, args.repeats, bandwidth) for s in args.sizes for w in args.workers]
        memory = memory_row(100 if 100 in args.sizes else args.sizes[0], max(args.workers))
    finally:
        ray.shutdown()
    lines = [f"# Weight sync (`python bench/sync.py{' --quick' if args.quick else ''}`, "
             f"{time.strftime('%Y-%m-%d')}, 2 cores, local Ray)", "",
             f"memcpy bandwidth in this run: {bandwidth / 1e9:.1f} GB/s; times are medians of {args.repeats}.", "",
             "| size | workers | jointrl | memcpy bound (W+1)·S/bw | × bound | naive (torch state dict per worker) "
             "| naive / jointrl | collective (gloo) |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['MB']:.0f} MB | {r['W']} | {r['jointrl_ms']:.1f} ms | {r['bound_ms']:.1f} ms | "
              f"{r['vs_bound']:.2f}× | {r['naive_ms']:.1f} ms | {r['speedup']:.1f}× | {r['collective_ms']:.1f} ms |"
              for r in rows]
    lines += ["", f"Memory of {memory['W']} rollout workers holding a {memory['MB']:.0f} MB generator, in copies of it: "
              f"shared (read-only map of the object store) {memory['shared']:.2f}×, private copies "
              f"{memory['private']:.2f}×."]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
