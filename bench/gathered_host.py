"""Host memory of each fsdp rank while a sharded expert's weights are gathered for a snapshot.

A stand-in for a widened tiny full fine-tune: a stack of --layers Linear layers of width --width
(fp32, about 4 · width² · layers bytes), sharded with FSDP2 over two gloo processes on this CPU,
then gathered whole as a snapshot gathers it (`experts.parallel.gathered`, one unit at a time).
Each rank samples its resident memory every 2 ms while it gathers and reports the peak above what
it held before (glibc's mmap threshold fixed, so freed tensors leave the resident memory). Two ways, in fresh processes:
- every rank keeps: each rank copies the whole model to the host (what every rank did before only
  the leader kept it);
- the leader keeps: rank 0 copies it, rank 1 takes part in every all-gather and copies nothing.
On CPU a unit's all-gather itself lands in host memory (on a GPU it lands on the device), so the
non-leader's figure is that unit's gather, not zero.

    python bench/gathered_host.py [--width 2048] [--layers 16] [--out bench/results/gathered_host.md]
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MB = 2 ** 20


def rank_main(rank: int, port: int, width: int, layers: int, leader_only: bool, out: str) -> None:
    """Rank `rank` of two: shard the stack, gather it, write (peak above the start, model bytes)."""
    import json
    import threading
    import time

    import psutil
    import torch
    from torch import nn

    from experts import parallel
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.ModuleList([nn.Linear(width, width, bias=False) for _ in range(layers)]))
    whole_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    parallel.join_group("127.0.0.1", port, "gang-0", rank, world_size=2, backend="gloo", timeout_s=120)
    parallel.shard(model, torch.device("cpu"))
    state = model.state_dict()
    process, peak, running = psutil.Process(), [0], [True]
    start = process.memory_info().rss

    def sample() -> None:
        while running[0]:
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.002)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    got = parallel.gathered(model, state, keep=rank == 0 or not leader_only)
    running[0] = False
    sampler.join()
    held = sum(t.numel() * t.element_size() for t in got.values()) if got else 0
    Path(out).write_text(json.dumps({"peak_above_start": max(peak[0], process.memory_info().rss) - start,
                                     "kept": held, "model": whole_bytes}))
    torch.distributed.destroy_process_group()


def measure(width: int, layers: int, leader_only: bool) -> list[dict]:
    import json

    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as tmp:
        outs = [str(Path(tmp) / f"rank{r}.json") for r in range(2)]
        context = multiprocessing.get_context("spawn")
        procs = [context.Process(target=rank_main, args=(r, store.port, width, layers, leader_only, outs[r]))
                 for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
        if [p.exitcode for p in procs] != [0, 0]:
            sys.exit(f"bench: a rank failed ({[p.exitcode for p in procs]})")
        return [json.loads(Path(o).read_text()) for o in outs]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "gathered_host.md"))
    args = p.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # the ranks' freed tensors leave their resident memory
    rows = {"every rank keeps": measure(args.width, args.layers, False),
            "the leader keeps": measure(args.width, args.layers, True)}
    model = rows["every rank keeps"][0]["model"]
    lines = ["# Host memory of each fsdp rank while a snapshot gathers the weights", "",
             f"Written by `python bench/gathered_host.py --width {args.width} --layers {args.layers}`. "
             f"{args.layers} x Linear({args.width}, {args.width}), fp32, {model / MB:.0f} MiB, "
             "sharded over 2 fsdp ranks (gloo, CPU); each rank's peak resident memory above what it held "
             "before the gathering.", "",
             "| gathered | rank | kept (MiB) | peak host memory above the start (MiB) | x the model |",
             "|---|---|---|---|---|"]
    lines += [f"| {label} | {rank} | {r['kept'] / MB:.0f} | {r['peak_above_start'] / MB:.0f} | "
              f"{r['peak_above_start'] / model:.2f} |" for label, ranks in rows.items() for rank, r in enumerate(ranks)]
    text = "\n".join(lines) + "\n"
    Path(args.out).write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
