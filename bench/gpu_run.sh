#!/usr/bin/env bash
# The GPU checks of issues 26, 28, 30 and 31, as one command for the device tool's `run` (a lent
# H100: Python 3.12, torch, no megatron-core, no Transformer Engine, no apex). Before the call, here:
#   echo /.whl/ >> .git/info/exclude; mkdir -p .whl
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.16.1
# then run `bash bench/gpu_run.sh [--only NAME,...]` there with carry [".whl"] and timeout_s ~520 (GPU_SKIP_PYTEST=1
# skips tests/gpu when an earlier call of the same lease ran it). What comes back under $OUT goes to
# bench/results/gpu/; bench/report_gpu.py sets the forecasts beside it.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi > "$OUT/nvidia_smi.txt" 2>&1
if [ "${GPU_SKIP_PYTEST:-0}" != 1 ]; then
  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/gpu -rA > "$OUT/pytest_gpu.txt" 2>&1
  echo "tests/gpu exit $?"; tail -3 "$OUT/pytest_gpu.txt"
fi
python3 bench/gpu_h100.py "$OUT" --train-budget-s 190 --budget-s 260 "$@" > "$OUT/run.log" 2>&1
echo "bench exit $?"; grep -v -i warn "$OUT/run.log" | cut -c1-330
cat ~/.cache/capture-megatron/cuda-*.jsonl 2>/dev/null | gzip > "$OUT/cuda_records.jsonl.gz"
