#!/usr/bin/env bash
# The packages a bare GPU machine lacks for bench/gpu_smoke.sh, prepared here as one compressed
# folder that travels with the working tree: .gpukit/site.tar.xz (under 60 MiB; git ignores it).
#
# The lent GPU machine (one H100 or H200; python3 3.12 with torch, transformers, peft, accelerate,
# safetensors, tokenizers, huggingface_hub, numpy, pyyaml, tqdm, matplotlib, tensorboard, aiohttp,
# grpcio, protobuf ... but no package registry and no model hub) lacks what jointrl imports beyond
# those: Ray (and jsonschema, which Ray needs), diffusers, pydantic, datasets (the `prompts` task's
# preflight asks for it) with their own needs. They are installed here for CPython 3.12 on
# manylinux x86-64 (pip downloads the wheels for that platform, whatever this machine runs), and
# Ray is cut to what `ray.init` of a local node, actors, placement groups and concurrency groups
# use: its Java jars, the dashboard's web client and its libraries (rllib, tune, train, serve, data,
# llm, workflow) are dropped, and its binaries stripped of symbols. bench/gpu_smoke.sh unpacks the
# archive when it is there and puts it on PYTHONPATH (before the machine's own packages).
#
#   bench/gpu_kit.sh          # builds .gpukit/ (1.5 minutes here), prints its size and contents
#
# Run it in the checkout the session was started in (the device tool sends that one). Then ONE
# call of the device tool answers (its `run`; the archive travels as a carried path):
#   run(command="export HF_HUB_OFFLINE=1; bash bench/gpu_smoke.sh --preset gpu --random 2>&1 | tee $OUT/gpu-random.log;
#                bash bench/gpu_smoke.sh --preset all --tiny 2>&1 | tee $OUT/gpu-tiny.log",
#       carry=[".gpukit"], timeout_s=540)
# It prints, per run, the plan, the random models built (GB, seconds), one table (per GPU: the
# Ray GPU id, planned GB, peak GB, ratio, actors; then each check: completed, first update on
# policy, weights travelled as asked, every planned GPU used, each GPU's peak against the plan)
# and `GPU SMOKE <preset>: PASSED` or `FAILED`; last `GPU SMOKE: k of n passed`. The random run
# comes first: it is the one with a memory verdict (the tiny stand-ins are planned under 1 GB), and
# its log is back in $OUT even if the tiny runs are cut by the timeout. 540 s leaves a lent
# machine's 15 minutes room for its start and one shorter rerun (`--preset gpu --random` alone).
#
# Checked here (no GPU): the unpacked archive under CPython 3.12.1 with the machine's
# huggingface_hub 1.33 starts a local Ray that places actors by placement group, runs concurrency
# groups and reports GPU ids, and imports pydantic and diffusers; the same cut of Ray (cp311) with
# the machine's transformers 5.17 and huggingface_hub 1.33 and this diffusers trains `random:`
# models two steps through Ray (tests/test_random_models.py's config in ray mode).
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=.gpukit
LIMIT_MIB=60
PYTHON=${PYTHON:-.venv/bin/python}
# what the machine lacks, at the versions checked as the header says: the machine's own
# transformers 5.17 and huggingface_hub 1.33 satisfy this diffusers (huggingface-hub>=1.32,
# safetensors>=0.8); Ray's pb2 files load with any protobuf>=3.20; datasets is only asked for by
# the preflight of a `prompts` task (prompt files are read without it; a dataset id or parquet file
# would need the machine's pyarrow to be >= 24)
PACKAGES=(
  ray==2.60.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
  diffusers==0.42.1
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
)
# Ray's parts that jointrl's runs never load (ray/__init__.py imports them lazily, on first use)
RAY_UNUSED=(jars rllib tune train serve data llm workflow dashboard/client air)

exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF "/$KIT/" "$exclude" 2>/dev/null || echo "/$KIT/" >>"$exclude"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
site=$work/site
"$PYTHON" -m pip install --quiet --no-deps --no-compile --target "$site" --python-version 3.12 --implementation cp \
  --only-binary=:all: --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 "${PACKAGES[@]}" \
  2> >(grep -v "is neither a file nor a directory" >&2)
for part in "${RAY_UNUSED[@]}"; do rm -rf "${site:?}/ray/$part"; done
rm -rf "$site/bin"
find "$site" -name __pycache__ -prune -exec rm -rf {} +
find "$site" -type d \( -name tests -o -name test \) -path "*/ray/*" -prune -exec rm -rf {} +
find "$site/ray" -type f \( -name "*.so" -o -perm -u+x \) -exec sh -c 'file -b "$1" | grep -q ELF && strip --strip-unneeded "$1"' _ {} \;
"$PYTHON" -m pip list --path "$site" --format freeze 2>/dev/null | sort >"$work/MANIFEST" || true

rm -rf "$KIT"
mkdir -p "$KIT"
tar -C "$site" -cf - . | xz -9e -T0 >"$KIT/site.tar.xz"
cp "$work/MANIFEST" "$KIT/MANIFEST"
size=$(stat -c %s "$KIT/site.tar.xz")
echo "$KIT/site.tar.xz: $((size / 1024 / 1024)) MiB ($(du -sm "$site" | cut -f1) MiB unpacked); packages:"
sed 's/^/  /' "$KIT/MANIFEST"
if [ "$size" -gt $((LIMIT_MIB * 1024 * 1024)) ]; then
  echo "gpu_kit: $KIT/site.tar.xz is over $LIMIT_MIB MiB: with the working tree it would not travel (64 MiB in all)" >&2
  exit 1
fi
