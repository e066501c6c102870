"""A reward term scored through `jointrl serve-reward` on the loopback address against the same term
in process: the time per batch side by side, and the bytes each image costs on the wire.

The term is prompts-tiny's clip_score (a tiny CLIP: its own compute is small, so the ratio is close
to the protocol's worst case; a real reward model's forward pass makes the overhead a smaller
share). Images are random, at each size given, in batches of 16 (the term's batch_size); both
sides at one torch thread.

    python bench/http_reward.py [--sizes 64 512] [--batches 5] [--out bench/results/http_reward.md]
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from datetime import date
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "http_reward.md"))
    args = parser.parse_args()
    import torch
    torch.set_num_threads(1)
    from driver.commands.score import term_config
    from driver.commands.serve_reward import server_for
    from tasks.base import TextPrompt
    from tasks.rewards import resolve
    from tasks.rewards.http import HttpOptions, HttpReward, request_body
    config, term = term_config("prompts-tiny", [], "clip_score")
    own = resolve(term.fn)(term.options(), torch.device("cpu"))
    server = server_for(config, "clip_score", term, host="127.0.0.1", port=0, max_request_mb=1024)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    remote = HttpReward(HttpOptions(url=f"http://127.0.0.1:{server.server_address[1]}", batch_size=16), None)
    prompts = [TextPrompt(f"a photo of object {i}") for i in range(16)]
    refinements = [{} for _ in prompts]
    rows = []
    for size in args.sizes:
        images = np.random.default_rng(size).uniform(-1, 1, (16, 3, size, size)).astype(np.float32)
        here, there, encoding = [], [], []
        for _ in range(args.batches + 1):  # the first of each is a warm-up, left out
            start = time.perf_counter()  # the client's PNG, base64 and JSON encoding of one batch
            wire = len(json.dumps(request_body(images, prompts, refinements)).encode()) / len(prompts)
            encoding.append(time.perf_counter() - start)
            start = time.perf_counter()
            a = own(images, prompts, refinements)
            here.append(time.perf_counter() - start)
            start = time.perf_counter()
            b = remote(images, prompts, refinements)
            there.append(time.perf_counter() - start)
            assert np.array_equal(a, b) or np.allclose(a, b, rtol=0, atol=1e-6), (a, b)
        h, t, encode = (float(np.median(x[1:])) for x in (here, there, encoding))
        rows.append((size, h, t, t / h, wire, encode))
        print(f"{size}px: in process {h * 1e3:.1f} ms, served {t * 1e3:.1f} ms ({t / h:.2f}x), "
              f"{wire / 1024:.1f} KiB per image on the wire, encoding {encode * 1e3:.0f} ms", flush=True)
    server.shutdown()
    lines = ["# A reward served over HTTP against the same term in process", "",
             f"Written by `python bench/http_reward.py` on {date.today()}: prompts-tiny's clip_score (a tiny CLIP), "
             f"batches of 16 random images, the median of {args.batches} batches after a warm-up (each timing), one torch thread "
             f"on both sides, the server on the loopback address in a thread of the same process (JSON, base64 "
             f"PNGs). The scores agree.", "",
             "| image | in process (ms/batch) | served (ms/batch) | served / in process | of which the client's "
             "encoding (ms/batch) | bytes per image sent |", "|---|---|---|---|---|---|"]
    lines += [f"| {s}x{s} | {h * 1e3:.1f} | {t * 1e3:.1f} | {r:.2f}x | {e * 1e3:.0f} | {w / 1024:.1f} KiB |"
              for s, h, t, r, w, e in rows]
    lines += ["", "Random pixels are PNG's worst case (they do not compress, and PNG's filters work hardest on them): "
              "a generated image is smaller on the wire and faster to encode. Most of the served time is the "
              "client's encoding and the server's decoding, per image and on the CPU, whatever the reward model: "
              "the HTTP term suits rewards whose own model dominates (VLM judges, detectors) or that cannot share "
              "the run's environment, not a small model that a reward actor could hold.", ""]
    Path(args.out).write_text("\n".join(lines))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
