"""bench/gpu_smoke.sh with a package kit (bench/gpu_kit.sh's .gpukit/site.tar.xz): it unpacks the
archive once and runs the acceptance script with the kit, then this repository, first on
PYTHONPATH (so the run and every Ray worker import the kit's packages over the machine's own).
Building the real kit needs the package registry and a minute: bench/gpu_kit.sh checks its size."""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_smoke_script_unpacks_the_kit_once_and_puts_it_first_on_the_path(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "kit_probe.py").write_text("WHERE = __file__\n")
    kit = tmp_path / "kit"
    kit.mkdir()
    with tarfile.open(kit / "site.tar.xz", "w:xz") as tar:
        tar.add(site / "kit_probe.py", arcname="kit_probe.py")
    (kit / "MANIFEST").write_text("kit-probe==1\n")
    probe = tmp_path / "python"  # stands in for the interpreter: says what the script gave it
    probe.write_text('#!/bin/sh\nexec "$REAL_PYTHON" -c "import kit_probe, os, sys; '
                     'print(kit_probe.WHERE); print(os.environ[\'PYTHONPATH\']); print(sys.argv[1:])" "$@"\n')
    probe.chmod(0o755)
    unpacked = tmp_path / "unpacked"
    env = {**os.environ, "GPUKIT": str(kit), "GPUKIT_DIR": str(unpacked), "PYTHON": str(probe),
           "REAL_PYTHON": sys.executable, "PYTHONPATH": "/elsewhere"}

    def run() -> list[str]:
        return subprocess.run(["bash", str(ROOT / "bench" / "gpu_smoke.sh"), "--preset", "gpu", "--random"], env=env,
                              capture_output=True, text=True, check=True, timeout=60).stdout.splitlines()
    said, where, path, args = run()
    assert "kit-probe==1" in said and str(unpacked) in said
    assert where == str(unpacked / "kit_probe.py")
    assert path.split(":") == [str(unpacked), str(ROOT), "/elsewhere"] and args == "['bench/gpu_smoke.py', '--preset', 'gpu', '--random']"
    (kit / "site.tar.xz").write_bytes(b"")  # unpacked once: the folder is reused, the archive not read again
    assert run()[1] == str(unpacked / "kit_probe.py")
