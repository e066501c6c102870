"""Per-step metrics: the JSONL contract of SPEC §4, and the one-line progress a user watches."""
from __future__ import annotations

import json
from pathlib import Path


class MetricsLog:
    """Appends one JSON object per step to RUN_DIR/metrics.jsonl, flushed as it is written."""

    def __init__(self, path: Path):
        self.path = path
        self.rows: list[dict] = []

    def append(self, row: dict) -> None:
        self.rows.append(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def progress_line(row: dict) -> str:
    versions = " ".join(f"{k.split('/', 1)[1].replace('refiner_', 'r')}={int(v)}"
                        for k, v in row.items() if k.startswith("version/") and k != "version/text_encoder")
    return f"reward={row['reward/total']:.3f} v[{versions}] {row['time/step_s']:.2f}s/step"
