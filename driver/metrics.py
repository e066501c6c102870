"""Per-step metrics: the JSONL contract of SPEC §4, and the one-line progress a user watches."""
from __future__ import annotations

import json
from pathlib import Path


class MetricsLog:
    """Appends one JSON object per step to RUN_DIR/metrics.jsonl, flushed as it is written.

    On resume (`keep_before` > 0) the rows of steps before it are kept and the rest, written after
    the checkpoint by the run that stopped, are dropped: those steps are trained again."""

    def __init__(self, path: Path, keep_before: int = 0):
        self.path = path
        self.rows: list[dict] = []
        if keep_before:
            rows = [parse(line) for line in (path.read_text().splitlines() if path.is_file() else [])]
            self.rows = [r for r in rows if r is not None and r["step"] < keep_before]
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in self.rows))
            tmp.replace(path)

    def append(self, row: dict) -> None:
        self.rows.append(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def parse(line: str) -> dict | None:
    """One metrics row; None for a line cut short by a killed process (always a later step)."""
    try:
        return json.loads(line)
    except ValueError:
        return None


def progress_line(row: dict) -> str:
    versions = " ".join(f"{k.split('/', 1)[1].replace('refiner_', 'r')}={int(v)}"
                        for k, v in row.items() if k.startswith("version/") and k != "version/text_encoder")
    reward = "n/a" if row["reward/total"] is None else f"{row['reward/total']:.3f}"
    dropped = f" dropped={row['faults/dropped_samples']}" if row.get("faults/dropped_samples") else ""
    return f"reward={reward} v[{versions}]{dropped} {row['time/step_s']:.2f}s/step"
