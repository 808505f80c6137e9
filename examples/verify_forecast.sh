#!/usr/bin/env bash
# Check the memory forecast against a measurement on this machine's CPU: `capture-megatron verify`
# plans a small Llama-style GPT (RMSNorm, SwiGLU, RoPE, grouped-query attention) for 2 processes,
# trains that plan for 2 iterations under torchrun (gloo), and prints every pipeline rank's
# predicted and measured peak with the error; it exits 1 when a rank is off by more than
# --tolerance (2% by default). No GPU needed; about a minute with a warm profiling cache.
# Usage: bash examples/verify_forecast.sh [WORKDIR]   (default: a new temporary folder)
set -euo pipefail
WORK="${1:-$(mktemp -d)}"
mkdir -p "$WORK" && cd "$WORK"

capture-megatron verify --device cpu --nproc 2 --tolerance 0.02 \
    --num-layers 6 --hidden-size 64 --num-attention-heads 4 --group-query-attention \
    --num-query-groups 2 --swiglu --normalization RMSNorm --position-embedding-type rope \
    --disable-bias-linear --seq-length 128 --max-position-embeddings 128 --vocab-size 512 \
    --pipeline-model-parallel-size 2 --micro-batch-size 2 --global-batch-size 8 \
    --mock-data --train-iters 2 --no-progress --json verify.json

# verify.json holds the plan and, per rank, the predicted and measured bytes and the error.
python3 - <<'PY'
import json

v = json.load(open("verify.json"))
worst = max(abs(rank["error"]) for rank in v["ranks"])
print(f"verify.json: layout {v['plan']['layout']}, {len(v['ranks'])} pipeline ranks, "
      f"max |error| {100 * worst:.2f}% on {v['device']}")
PY
