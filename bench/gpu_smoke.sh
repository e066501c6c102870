#!/usr/bin/env bash
# The GPU acceptance run (bench/gpu_smoke.py): a preset for a few steps on this machine's GPUs,
# checked against its memory plan; one table per run, PASSED or FAILED.
#   bench/gpu_smoke.sh --preset sd3                 the preset's real models (`jointrl download --config sd3` first)
#   bench/gpu_smoke.sh --preset flux2-klein --tiny  its family's tiny random stand-in, on one GPU, no download
#   bench/gpu_smoke.sh --preset all --tiny          every GPU preset's tiny stand-in
# Presets: gpu, sd3, flux1, flux2-klein, qwen-image, geneval, pickscore, ocr. Other options:
# --collective (weight sync by NCCL broadcast), --steps N, --prompts N, --run-dir DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" bench/gpu_smoke.py "$@"
