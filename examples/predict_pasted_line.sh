#!/usr/bin/env bash
# Predict every pipeline rank's peak memory of a Megatron-LM launch line pasted as it is: the
# pretrain_gpt.py flags of the "GPT-3 Training Example" in NVIDIA/Megatron-LM's
# docs/user-guide/training-examples.md at tag core_v0.16.1 (its `torchrun --nproc_per_node=8`
# line; /path/to/... replaced by /data/..., as in tests/data/megatron_lm_examples/
# docs_training_examples_gpt3.args). Every pretrain_gpt.py flag is accepted: those that cannot
# change memory (data, checkpoints, learning rate) change nothing here, and a flag that changes
# memory in a way not modelled would be refused by name. No GPU needed: the GPU kernel set runs on a fake CUDA device
# (a minute or two with an empty profiling cache).
# Usage: bash examples/predict_pasted_line.sh [WORKDIR]   (default: a new temporary folder)
set -euo pipefail
WORK="${1:-$(mktemp -d)}"
mkdir -p "$WORK" && cd "$WORK"

# The pasted line, then the cluster: the 8 GPUs of its torchrun line, 80 GiB each.
capture-megatron predict \
    --tensor-model-parallel-size 2 \
    --pipeline-model-parallel-size 2 \
    --num-layers 24 \
    --hidden-size 2048 \
    --num-attention-heads 16 \
    --seq-length 1024 \
    --max-position-embeddings 1024 \
    --micro-batch-size 2 \
    --global-batch-size 16 \
    --train-iters 100000 \
    --lr 1.5e-4 \
    --min-lr 1.0e-5 \
    --lr-decay-style cosine \
    --lr-warmup-iters 1000 \
    --weight-decay 0.1 \
    --clip-grad 1.0 \
    --fp16 \
    --data-path /data/my_text_document \
    --split 949,50,1 \
    --save /data/checkpoints \
    --load /data/checkpoints \
    --gpus 8 --gpu-memory-gib 80 --no-progress --json prediction.json

# prediction.json: the plan the line describes, each rank's predicted peak and its breakdown.
python3 - <<'PY'
import json

p = json.load(open("prediction.json"))
peaks = ", ".join(f"{b / 2**30:.2f}" for b in p["predicted_peak_bytes"])
print(f"prediction.json: TP {p['plan']['tp']} PP {p['plan']['pp']} DP {p['plan']['dp']}, "
      f"layout {p['plan']['layout']}; peak GiB per pipeline rank: {peaks}; fits: {p['fits']}")
PY
