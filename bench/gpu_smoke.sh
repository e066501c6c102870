#!/usr/bin/env bash
# Two joint steps on one GPU, for when one is lent (see bench/gpu_smoke.py).
#   bench/gpu_smoke.sh            the `gpu` preset: Qwen2.5-0.5B-Instruct refiners, SD3.5-medium, LoRA, bf16
#                                 (models from the Hugging Face cache or the hub)
#   bench/gpu_smoke.sh --tiny     tiny random HF models built on the spot: no download, same GPU code paths
#   bench/gpu_smoke.sh --preset geneval [--tiny]   a real task (also pickscore, ocr): its reward model in a
#                                 pool of reward actors on the GPU; --tiny: prompts-tiny's models, data and
#                                 every reward term, placed on the GPU as the preset places them
#   bench/gpu_smoke.sh --family flux1 [--tiny]   a generator family's preset (also sd3, flux2-klein,
#                                 qwen-image); --tiny: its tiny random pipeline with the preset's settings
# Extra arguments go to bench/gpu_smoke.py (--collective: weight sync by NCCL broadcast; --run-dir DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" bench/gpu_smoke.py "$@"
