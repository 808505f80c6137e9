#!/usr/bin/env bash
# Copy and edit: plan a GPT for this node's GPUs, then train it with the balanced layout under torchrun.
# Usage: bash launch/torchrun.sh [extra Megatron flags...]
# Multi-node without Slurm: set NNODES, NODE_RANK and MASTER_ADDR on every node (same command).
set -euo pipefail
NPROC="${NPROC:-$(python -c 'import torch; print(max(torch.cuda.device_count(), 1))')}"
NNODES="${NNODES:-1}"; NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-localhost}"; MASTER_PORT="${MASTER_PORT:-29500}"
GPU_MEMORY_GIB="${GPU_MEMORY_GIB:-80}"

read -ra MODEL <<< "${MODEL:---preset llama2-7b}"   # or --num-layers/--hidden-size/... or --hf-config config.json
read -ra TRAIN <<< "${TRAIN:---mock-data --train-iters 100 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine}"
GLOBAL_BATCH="${GLOBAL_BATCH:-256}"

# 1. plan: writes the plan JSON (sizes, layout, per-stage recompute) and a per-stage PNG
capture-megatron plan "${MODEL[@]}" --gpus $((NPROC * NNODES)) --gpu-memory-gib "$GPU_MEMORY_GIB" \
    --global-batch-size "$GLOBAL_BATCH" --json plan.json --png plan.png "$@"
# 2. train exactly that plan: the model flags plus the plan's megatron_args
mapfile -t PLAN_ARGS < <(python -c 'import json; print("\n".join(json.load(open("plan.json"))["megatron_args"]))')
mapfile -t MODEL_ARGS < <(python -c 'import json; print("\n".join(json.load(open("plan.json"))["model_args"]))')
export CUDA_DEVICE_MAX_CONNECTIONS=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
exec python -m torch.distributed.run --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" --max-restarts 0 \
    -m capture_megatron.pretrain_gpt "${MODEL_ARGS[@]}" "${PLAN_ARGS[@]}" "${TRAIN[@]}" --memory-report memory.json
