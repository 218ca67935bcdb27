#!/usr/bin/env bash
# GPU checks and benchmarks in one go, on a node with NVIDIA GPUs and no network:
# installs the wheels carried in .whl/ (see docs/contributing.md), then runs the GPU tests and the benchmarks.
#   bash bench/gpu_run.sh OUTDIR [tests|suite|mlflow|patterns|ray-gpu|phases|scaling|bench|watch|memory|demos]...   (suite: MODULES=..., SUITE_TIMEOUT=...)
set -u
out=${1:?output directory}; shift
# Wheels come in .whl/ and, where one transfer cannot hold them all, in more folders .whl*/ over several
# runs on the same machine; a wheel too big for one transfer comes in pieces NAME.whl.part-*, joined once all
# are there. Each folder is installed once per machine, into a target of its own: pip --target replaces a
# package folder already there, which would cut a namespace package (opentelemetry) shared by two folders.
mkdir -p /tmp/wheels
paths=""
for dir in .whl .whl?*; do
  [ -d "$dir" ] || continue
  cp "$dir"/*.part-* /tmp/wheels/ 2>/dev/null
  target=/tmp/site/${dir#.}
  if [ ! -e "$target/.installed" ] && ls "$dir"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" "$dir"/*.whl || exit 1
    touch "$target/.installed"
  fi
  paths=$paths:$target
done
for first in /tmp/wheels/*.whl.part-aa; do
  [ -e "$first" ] || continue
  whl=${first%.part-aa}
  target=/tmp/site/$(basename "$whl" .whl)
  if [ ! -e "$target/.installed" ]; then
    cat "$whl".part-* > "$whl"
    python3 -m zipfile -t "$whl" >/dev/null 2>&1 &&
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$target" "$whl" && touch "$target/.installed"
  fi
  [ -e "$target/.installed" ] && paths=$paths:$target
done
# Ray comes packed in .ray/ (a tar.xz of its wheel's files, and the small wheels it needs), when carried.
if ls .ray/ray-*.tar.xz >/dev/null 2>&1 && [ ! -e /tmp/site/ray/.installed ]; then
  mkdir -p /tmp/site/ray && tar -xJf .ray/ray-*.tar.xz -C /tmp/site/ray &&
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site/ray .ray/*.whl && touch /tmp/site/ray/.installed
fi
[ -e /tmp/site/ray/.installed ] && paths=$paths:/tmp/site/ray
export PYTHONPATH=${paths#:}:$PWD PYTHONUNBUFFERED=1 PATH=/tmp/site/whl/bin:$PATH
# Data files of wheels installed with --target (nbconvert's templates) are found through JUPYTER_PATH.
JUPYTER_PATH=$(ls -d /tmp/site/*/share/jupyter 2>/dev/null | paste -sd:)
export JUPYTER_PATH
nvidia-smi --query-gpu=index,name,memory.used --format=csv | tee "$out/nvidia-smi-before.csv"
n=$(nvidia-smi -L | wc -l)
for what in "$@"; do
  case $what in
    tests)
      { timeout 400 python3 -m pytest -q -p no:cacheprovider -s tests/test_gpu.py tests/test_resources_gpu.py tests/test_hang_gpu.py tests/test_warm.py
        timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_magic.py; } 2>&1 | grep -v 'WARNING | Kernel is running' | tee "$out/pytest.log" ;;
    suite)  # the test suite as CI runs it (lint and types aside), modules in $MODULES (default: all)
      timeout "${SUITE_TIMEOUT:-560}" python3 -m pytest -q -p no:cacheprovider --durations=15 ${MODULES:-tests} 2>&1 \
        | grep -v 'WARNING | Kernel is running' | tee -a "$out/suite.log" | tail -40 ;;
    patterns) timeout 420 python3 bench/call_patterns.py --out "$out/call_patterns.json" 2>&1 | tail -30 | tee "$out/call_patterns.log" ;;
    ray-gpu) timeout 300 python3 bench/ray_gpu.py --out "$out/ray_gpu.json" 2>&1 | tail -40 | tee "$out/ray_gpu.log" ;;
    mlflow)
      { timeout 300 python3 bench/mlflow_launch.py --repeat 5 --ranks $(printf "%s\n" 1 "$n" | sort -un) --out "$out/mlflow_launch.json" 2>&1 | tail -12
        timeout 200 python3 bench/launch_phases.py --first-call --ranks "$n" 2>&1 | grep -v '^\[rank\|^air_magic'; } | tee "$out/mlflow.log" ;;
    phases) for r in 2 "$n"; do timeout 120 python3 bench/launch_phases.py --ranks "$r" 2>&1 | grep -v '^\[rank\|^air_magic'; done | tee "$out/phases.log" ;;
    scaling)
      for v in ${SCALING:-0 0,1}; do
        CUDA_VISIBLE_DEVICES=$v timeout 280 python3 bench/gpu_demos.py demo_notebooks/ddp.ipynb demo_notebooks/fsdp.ipynb demo_notebooks/deepspeed.ipynb --out "$out/scale-$v.json"
      done 2>&1 | tee "$out/scaling.log" ;;
    bench)
      for r in 2 "$n"; do
        timeout 240 python3 bench/launch.py --ranks "$r" --repeat 5 --out "$out/launch-$r.json" 2>&1 | grep -v WARN | tail -8
        timeout 180 python3 bench/ddp_step.py --ranks "$r" --out "$out/ddp-$r.json" 2>&1 | tail -2
        [ "$r" = "$n" ] && break
      done 2>&1 | tee "$out/bench.log" ;;
    watch) timeout 240 python3 bench/watch.py --ranks "$n" --steps 200 --rounds 3 --out "$out/watch-gpu.json" 2>&1 | tail -3 | tee "$out/watch.log" ;;
    memory)  # the allocation history's cost on a DDP step, then profile=5's latency on GPT-2 small
      { timeout 280 python3 bench/memory_history.py --out "$out/memory_history.json"
        timeout 280 python3 bench/profile_latency.py --ranks "$n" --out "$out/profile_latency.json"; } 2>&1 \
        | grep -v 'WARN' | tail -60 | tee "$out/memory.log" ;;
    demos) timeout 500 python3 bench/gpu_demos.py ${DEMOS:-} 2>&1 | tee "$out/demos.log" ;;
  esac
done
nvidia-smi --query-gpu=index,name,memory.used --format=csv | tee "$out/nvidia-smi-after.csv"
nvidia-smi --query-compute-apps=pid,used_memory --format=csv | tee -a "$out/nvidia-smi-after.csv"
