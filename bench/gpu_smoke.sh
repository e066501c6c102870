#!/usr/bin/env bash
# The GPU acceptance run (bench/gpu_smoke.py): a preset for a few steps on this machine's GPUs,
# checked against its memory plan; one table per run, PASSED or FAILED.
#   bench/gpu_smoke.sh --preset sd3                 the preset's real models (`jointrl download --config sd3` first)
#   bench/gpu_smoke.sh --preset gpu --random        its real architectures with random weights, built here (no hub)
#   bench/gpu_smoke.sh --preset flux2-klein --tiny  its family's tiny random stand-in, on one GPU, no download
#   bench/gpu_smoke.sh --preset all --tiny          every GPU preset's tiny stand-in
# Presets: gpu, sd3, flux1, flux2-klein, qwen-image, geneval, pickscore, ocr. Other options:
# --collective (weight sync by NCCL broadcast), --steps N, --prompts N, --run-dir DIR.
# Where .gpukit/site.tar.xz is ($GPUKIT/site.tar.xz; bench/gpu_kit.sh: Ray, diffusers, pydantic ...
# for a machine that lacks them and has no registry), it is unpacked once into $GPUKIT_DIR (default
# /tmp/jointrl-gpukit-<its digest>) and put first on PYTHONPATH, with this repository, for the run
# and every Ray worker it starts. Python: $PYTHON, else python3, else python.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
python=${PYTHON:-$(command -v python3 || command -v python)}
packed=${GPUKIT:-.gpukit}
if [ -f "$packed/site.tar.xz" ]; then
  digest=$(sha256sum "$packed/site.tar.xz" | cut -c1-12)
  kit=${GPUKIT_DIR:-/tmp/jointrl-gpukit-$digest}
  if [ ! -f "$kit/.unpacked" ]; then
    mkdir -p "$kit"
    if command -v xz >/dev/null; then
      tar -C "$kit" -xJf "$packed/site.tar.xz"
    else  # a bare image without xz: Python's own lzma
      "$python" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$packed/site.tar.xz" "$kit"
    fi
    touch "$kit/.unpacked"
  fi
  echo "gpu_smoke: packages from $packed ($(tr '\n' ' ' <"$packed/MANIFEST")) unpacked in $kit"
  export PYTHONPATH="$kit:$root${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$python" bench/gpu_smoke.py "$@"
