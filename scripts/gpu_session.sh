#!/usr/bin/env bash
# Every GPU check in one call, most important first, inside a time budget (the device is lent for minutes).
# On the GPU machine, from the repo root, with the wheels it lacks carried in .whl/ (see the closing notes):
#   BUDGET=380 bash scripts/gpu_session.sh      # logs under $OUT (or ./gpu-out)
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
BUDGET=${BUDGET:-380}; END=$(( $(date +%s) + BUDGET ))
left() { echo $(( END - $(date +%s) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
ONLY=${ONLY:-}  # e.g. ONLY="trainer_steps io_table" runs those steps alone
step() {  # step NAME SECONDS COMMAND...: run with the smaller of SECONDS and what is left
  local name=$1 want=$2; shift 2
  if [[ -n $ONLY && " $ONLY " != *" $name "* ]]; then return; fi
  local t; t=$(left); (( t > want )) && t=$want
  if (( t < 10 )); then echo "== $name: skipped, ${t}s left" | tee -a "$OUT/summary.txt"; return; fi
  local began=$(date +%s)
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "== $name: rc=$rc in $(( $(date +%s) - began ))s (limit ${t}s)" | tee -a "$OUT/summary.txt"
  tail -n 25 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/summary.txt"
step pytest_cuda 170 python3 -m pytest -q -p no:cacheprovider --noconftest -o addopts= \
  tests/checkpoint/test_cuda.py tests/checkpoint/test_cuda_memory.py tests/checkpoint/test_placement.py \
  tests/checkpoint/test_fast_tier_units.py tests/checkpoint/test_staging_deferred.py -rs
step nccl_bind 40 python3 scripts/gpu_check.py
step fast_tier_cuda 90 python3 benchmarks/fast_checkpoint.py --device cuda --repeats 2
step steps_around_save 120 python3 benchmarks/gpu_checkpoint.py --only steps --step-gib 2 --saves 5
step trainer_steps 150 python3 benchmarks/gpu_trainer.py --steps 1000 --repeats 6 --sizes 0,1
step io_table 200 python3 benchmarks/gpu_checkpoint.py --only io --gib 4 --repeats 1
cat "$OUT/summary.txt"
