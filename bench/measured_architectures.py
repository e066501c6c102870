"""Writes configs/architectures/measured.json: the memory measurements (experts/measurements.py) of
every model the presets' plans ask for, so that `jointrl plan --config <preset>` reads them instead
of tracing each architecture on the meta device (seconds per model, most of them importing
diffusers, transformers and peft).

Each preset is planned as `jointrl plan --config <preset>` plans it (its plan.target, both
layouts). A measurement already shipped under the same key (config files, inputs and tracing code
unchanged) is kept; the rest are traced (`--retrace`: all of them). Entries no preset asks for are
dropped, and models built here (`tiny:`) are not shipped. tests/test_plan.py checks that every
preset plans from this file alone and that each entry equals a fresh trace.

    python bench/measured_architectures.py [--retrace]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def presets() -> list[str]:
    return sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))


def plan_preset(name: str) -> None:
    """The measurements `jointrl plan --config name` asks for (a plan that does not fit still asks)."""
    from common.config import SettingError
    from driver.config import resolve_config
    from driver.commands.layout_plan import compare
    from driver.plan import config_target, plan_for
    config = resolve_config(name)
    target = config_target(config)
    try:
        plan_for(config, target)
    except SettingError as e:
        print(f"  {name}: {str(e).splitlines()[0][:100]}")
    compare(config, target)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--retrace", action="store_true", help="trace every model again, shipped or not")
    args = parser.parse_args()
    if args.retrace:
        os.environ["JOINTRL_REMEASURE"] = "1"
    from experts import measurements
    for name in presets():
        start = time.perf_counter()
        plan_preset(name)
        print(f"{name}: {len(measurements.used)} measurement(s) so far, {time.perf_counter() - start:.1f} s", flush=True)
    kept = {k: e for k, e in sorted(measurements.used.items(), key=lambda kv: kv[1]["what"])
            if "tiny:" not in e["what"]}
    measurements.SHIPPED.write_text(json.dumps(kept, indent=1) + "\n")
    print(f"wrote {len(kept)} measurement(s) to {measurements.SHIPPED.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
