#!/usr/bin/env bash
# Plan Llama 3 70B (the llama3-70b preset: 80 layers, hidden 8192, 64 heads, 8 query groups, FFN
# 28672, vocabulary 128256, sequence 8192, bf16) for 8 nodes x 8 GPUs of 80 GiB, then write and
# print the Slurm batch script that trains exactly that plan. Nothing runs on a GPU here: the plan
# profiles what it needs on the fake CUDA device (with an empty cache, minutes: every TP, CP and
# micro-batch size searched is profiled once).
# Usage: bash examples/plan_llama3_70b_slurm.sh [WORKDIR [PLAN FLAGS...]]   (WORKDIR default: a new
# temporary folder; PLAN FLAGS fix sizes the plan would search, e.g. --context-parallel-size 1)
# For a published Hugging Face config, write --hf-config path/to/config.json --seq-length 8192 in
# place of --preset llama3-70b.
set -euo pipefail
WORK="${1:-$(mktemp -d)}"
shift $(($# > 0 ? 1 : 0))
mkdir -p "$WORK" && cd "$WORK"

# 1. Plan for 64 GPUs: TP / PP / DP / VPP, micro-batch, recompute and the memory-balanced layout
#    that give the fastest estimated step that fits 80 GiB (plan.json holds all of it).
capture-megatron plan --preset llama3-70b --gpus 64 --gpu-memory-gib 80 \
    --global-batch-size 512 --no-progress --json plan.json "$@"

# 2. The batch script for that plan: 8 nodes x 8 GPUs, torchrun on each node; the data, training
#    and checkpoint flags go to every rank (replace --mock-data with your --data-path).
capture-megatron launch --plan-json plan.json --nodes 8 --gpus-per-node 8 \
    --partition gpu --time 04:00:00 --mock-data --train-iters 200 --lr 1.5e-4 \
    --save checkpoints --sbatch llama3_70b.sbatch

# 3. Print it; submit with `sbatch llama3_70b.sbatch`.
cat llama3_70b.sbatch
