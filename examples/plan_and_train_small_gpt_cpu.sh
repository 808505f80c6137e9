#!/usr/bin/env bash
# Plan a small GPT for 2 CPU processes, train exactly that plan under torchrun (gloo), and set each
# pipeline rank's measured peak beside the plan's forecast. No GPU needed; about a minute with a
# warm profiling cache (the first run profiles the model on CPU, about half a minute more).
# Usage: bash examples/plan_and_train_small_gpt_cpu.sh [WORKDIR]   (default: a new temporary folder)
set -euo pipefail
WORK="${1:-$(mktemp -d)}"
mkdir -p "$WORK" && cd "$WORK"

# 1. Plan: 8 layers over 2 pipeline stages; the planner picks the layout (memory-balanced with
#    --objective min-peak), recompute and the distributed optimizer, and writes plan.json.
capture-megatron plan --device cpu --gpus 2 --objective min-peak \
    --num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 128 \
    --max-position-embeddings 128 --vocab-size 512 \
    --pipeline-model-parallel-size 2 --micro-batch-size 2 --global-batch-size 8 \
    --no-progress --json plan.json

# 2. Train exactly that plan: the plan JSON's model_args + megatron_args as they are, plus data
#    (--mock-data: random tokens below --vocab-size) and a memory report of every rank.
json_list() { python3 -c 'import json, sys; print("\n".join(json.load(open(sys.argv[1]))[sys.argv[2]]))' "$@"; }
mapfile -t MODEL_ARGS < <(json_list plan.json model_args)
mapfile -t PLAN_ARGS < <(json_list plan.json megatron_args)
capture-megatron train --nproc 2 "${MODEL_ARGS[@]}" "${PLAN_ARGS[@]}" \
    --mock-data --train-iters 2 --no-progress --memory-report report.json

# 3. Forecast (plan.json) vs measurement (report.json), per pipeline rank.
python3 - <<'PY'
import json

plan, report = json.load(open("plan.json")), json.load(open("report.json"))
assert report["plan"]["layers_per_stage"] == plan["plan"]["layers_per_stage"], "another layout ran"
print(f"trained the planned layout {plan['plan']['layout']}")
measured = {}
for rank in report["ranks"]:
    measured[rank["pp_rank"]] = max(measured.get(rank["pp_rank"], 0), rank["peak_bytes"])
for r, predicted in enumerate(plan["predicted_peak_bytes"]):
    error = 100 * (predicted - measured[r]) / measured[r]
    print(f"pipeline rank {r}: predicted {predicted / 2**20:.2f} MiB, measured "
          f"{measured[r] / 2**20:.2f} MiB ({error:+.2f}%)")
PY
