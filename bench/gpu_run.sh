#!/usr/bin/env bash
# GPU checks and benchmarks in one go, on a node with NVIDIA GPUs and no network:
# installs the wheels carried in .whl/ (see README), then runs the GPU tests and the benchmarks.
#   bash bench/gpu_run.sh OUTDIR [tests|bench|demos]...
set -u
out=${1:?output directory}; shift
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
nvidia-smi --query-gpu=index,name,memory.used --format=csv | tee "$out/nvidia-smi-before.csv"
n=$(nvidia-smi -L | wc -l)
for what in "$@"; do
  case $what in
    tests)
      { timeout 300 python3 -m pytest -q -p no:cacheprovider -s tests/test_gpu.py tests/test_warm.py
        timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_magic.py; } 2>&1 | grep -v 'WARNING | Kernel is running' | tee "$out/pytest.log" ;;
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
    demos) timeout 500 python3 bench/gpu_demos.py ${DEMOS:-} 2>&1 | tee "$out/demos.log" ;;
  esac
done
nvidia-smi --query-gpu=index,name,memory.used --format=csv | tee "$out/nvidia-smi-after.csv"
nvidia-smi --query-compute-apps=pid,used_memory --format=csv | tee -a "$out/nvidia-smi-after.csv"
