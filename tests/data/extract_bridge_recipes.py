"""Write the Megatron settings of NVIDIA-NeMo/Megatron-Bridge's H100 pretraining performance recipes
(Apache-2.0) as pretrain_gpt.py flags: tests/data/megatron_bridge/<recipe>.args.

    git clone https://github.com/NVIDIA-NeMo/Megatron-Bridge
    git -C Megatron-Bridge checkout v0.3.1
    python tests/data/extract_bridge_recipes.py Megatron-Bridge
    (or any directory holding its scripts/performance, with --commit 9c9dd848...)

Tag v0.3.1 is the Bridge release for megatron-core <0.17 (pyproject: megatron-core>=0.15.0a0,
<0.17.0). A recipe is scripts/performance/configs/<family>/<family>_llm_pretrain.py's
<model>_pretrain_config_h100 for a precision (bf16; fp8_cs, FP8 current scaling): the model's
pretrain recipe (src/megatron/bridge/recipes/...), the family's common performance settings,
the workload base config <MODEL>_PRETRAIN_CONFIG_H100_<PRECISION>_V1 applied by
scripts/performance/utils/overrides.py set_workload_base_configs, and the common performance
overrides there. The Bridge builds megatron-core's TransformerConfig directly; the same settings
as Megatron-LM flags are:
- the workload base config (read here from the source with `ast`: parallel sizes, batch,
  recompute, CPU offloading, CUDA graphs, Megatron-FSDP, NCCL user buffers, the flex dispatcher's
  backend, MoE all-to-all overlap, a pipeline layout) -> WORKLOAD rules below;
- the model (MODELS: each recipe loads AutoBridge.from_hf_pretrained(<HF id>); the flags are its
  architecture as the Bridge's provider class for that model spells it, cited per model);
- the recipe and family settings (FAMILY, cited per entry) and the precision (PRECISION:
  utils/precision.py get_precision_config; bf16_mixed / bf16_with_fp8_current_scaling_mixed in
  src/megatron/bridge/training/mixed_precision.py, first/last BF16 layers off in performance runs);
- the Bridge's own rules: TP communication overlap only with TP > 1 and sequence parallelism
  (training/comm_overlap.py), sequence parallelism whenever TP > 1 (utils/utils.py
  WorkloadBaseConfig.sequence_parallel); the common overrides (utils/overrides.py
  _set_common_perf_overrides): TE cross-entropy fusion, no NaN checks, mock data.
The world size is the workload's num_gpus.
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import shlex
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "data" / "megatron_bridge"
CONFIGS = "scripts/performance/configs"
WORKLOADS = {
    "llama3_8b": "llama/llama3_workload_base_configs.py",
    "llama3_70b": "llama/llama3_workload_base_configs.py",
    "llama31_405b": "llama/llama31_workload_base_configs.py",
    "deepseek_v3": "deepseek/deepseek_workload_base_configs.py",
    "qwen3_30b_a3b": "qwen/qwen3_workload_base_configs.py",
    "qwen3_235b_a22b": "qwen/qwen3_workload_base_configs.py",
    "nemotronh_56b": "nemotronh/nemotronh_workload_base_configs.py",
}
RECIPES = [(m, p) for m in WORKLOADS for p in ("bf16", "fp8_cs") if m != "nemotronh_56b"]
RECIPES.append(("nemotronh_56b", "fp8_cs"))  # the family's only H100 recipe
"""(model, precision): the 13 H100 pretraining recipes at v0.3.1 of these families."""

LLAMA = (
    "--swiglu --normalization RMSNorm --disable-bias-linear --untie-embeddings-and-output-weights "
    "--position-embedding-type rope --rotary-percent 1.0 --attention-dropout 0.0 "
    "--hidden-dropout 0.0 --vocab-size 128256 --norm-epsilon 1e-05 --rotary-base 500000 "
    "--group-query-attention --num-query-groups 8"
)
QWEN3_MOE = (
    "--swiglu --normalization RMSNorm --disable-bias-linear --untie-embeddings-and-output-weights "
    "--position-embedding-type rope --attention-dropout 0.0 --hidden-dropout 0.0 "
    "--vocab-size 151936 --norm-epsilon 1e-6 --rotary-base 1000000 --qk-layernorm "
    "--kv-channels 128 --group-query-attention --num-query-groups 4 --num-experts 128 "
    "--moe-router-topk 8 --moe-aux-loss-coeff 1e-3 --moe-router-load-balancing-type aux_loss "
    "--moe-grouped-gemm --moe-permute-fusion --max-position-embeddings 40960"
)
MODELS = {
    # src/megatron/bridge/models/llama/llama_provider.py Llama3ModelProvider8B (HF
    # meta-llama/Meta-Llama-3-8B)
    "llama3_8b": "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 "
    "--num-attention-heads 32 --max-position-embeddings 8192 " + LLAMA,
    # Llama3ModelProvider70B (meta-llama/Meta-Llama-3-70B)
    "llama3_70b": "--num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 "
    "--num-attention-heads 64 --max-position-embeddings 8192 " + LLAMA,
    # Llama31ModelProvider405B (meta-llama/Meta-Llama-3.1-405B): Llama 3.1 RoPE scaling, factor 8
    "llama31_405b": "--num-layers 126 --hidden-size 16384 --ffn-hidden-size 53248 "
    "--num-attention-heads 128 --max-position-embeddings 131072 --use-rope-scaling "
    "--rope-scaling-factor 8.0 " + LLAMA,
    # src/megatron/bridge/models/deepseek/deepseek_provider.py DeepSeekV3ModelProvider with
    # DeepSeekModelProvider's architecture (deepseek-ai/DeepSeek-V3); MTP from the recipe
    "deepseek_v3": "--num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 "
    "--num-attention-heads 128 --kv-channels 128 --swiglu --normalization RMSNorm "
    "--disable-bias-linear --untie-embeddings-and-output-weights --position-embedding-type rope "
    "--rotary-base 10000 --qk-layernorm --multi-latent-attention --q-lora-rank 1536 "
    "--kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 "
    "--rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0 --num-experts 256 "
    "--moe-ffn-hidden-size 2048 --moe-shared-expert-intermediate-size 2048 "
    "--moe-layer-freq ([0]*3+[1]*58) --moe-router-topk 8 --moe-router-num-groups 8 "
    "--moe-router-group-topk 4 --moe-router-topk-scaling-factor 2.5 --moe-aux-loss-coeff 1e-4 "
    "--moe-router-score-function sigmoid --moe-router-enable-expert-bias "
    "--moe-router-bias-update-rate 1e-3 --moe-grouped-gemm --moe-permute-fusion "
    "--make-vocab-size-divisible-by 1280 --vocab-size 129280 --max-position-embeddings 163840 "
    "--mtp-num-layers 1 --mtp-loss-scaling-factor 0.1 --attention-dropout 0.0 --hidden-dropout 0.0",
    # src/megatron/bridge/models/qwen/qwen_provider.py Qwen3MoEModelProvider30B_A3B
    "qwen3_30b_a3b": "--num-layers 48 --hidden-size 2048 --num-attention-heads 32 "
    "--ffn-hidden-size 6144 --moe-ffn-hidden-size 768 " + QWEN3_MOE,
    # Qwen3MoEModelProvider235B_A22B
    "qwen3_235b_a22b": "--num-layers 94 --hidden-size 4096 --num-attention-heads 64 "
    "--ffn-hidden-size 12288 --moe-ffn-hidden-size 1536 " + QWEN3_MOE,
    # src/megatron/bridge/models/nemotronh/nemotron_h_provider.py NemotronHModelProvider56B: a
    # hybrid Mamba model (Megatron-LM trains it with pretrain_mamba.py); vocabulary of
    # nvidia/Nemotron-H-56B-Base-8K
    "nemotronh_56b": "--is-hybrid-model --hybrid-override-pattern "
    "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-"
    "M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M- --num-layers 118 --hidden-size 8192 "
    "--ffn-hidden-size 32768 --num-attention-heads 64 --group-query-attention "
    "--num-query-groups 8 --mamba-state-dim 256 --mamba-num-heads 256 --mamba-num-groups 8 "
    "--mamba-head-dim 64 --squared-relu --normalization RMSNorm --disable-bias-linear "
    "--untie-embeddings-and-output-weights --position-embedding-type none --vocab-size 131072 "
    "--max-position-embeddings 8192",
}
COMMON = (
    "--use-mcore-models --transformer-impl transformer_engine --use-distributed-optimizer "
    "--overlap-param-gather --cross-entropy-loss-fusion --cross-entropy-fusion-impl te "
    "--no-check-for-nan-in-loss-and-grad --manual-gc --mock-data --tokenizer-type NullTokenizer "
    "--train-iters 50 --eval-iters 0 --log-interval 1 --grad-reduce-in-bf16"
)
"""Every recipe: its pretrain recipe's DDP / optimizer settings (use_distributed_optimizer,
overlap_param_gather, cross_entropy_loss_fusion, manual_gc), the common performance overrides
(cross_entropy_fusion_impl te, check_for_nan_in_grad off, 50 iterations, no evaluation) and the
families' common configs (grad_reduce_in_fp32 False: Megatron-LM's --grad-reduce-in-bf16)."""
FAMILY = {
    # recipes/llama/llama3.py llama3_8b_pretrain_config; the H100 script sets
    # CommOverlapConfig(tp_comm_overlap=TP > 1); set_llama3_common_configs: sequence 8192
    "llama3_8b": ("--seq-length 8192 --overlap-grad-reduce --ddp-average-in-collective", True),
    # llama3_70b_pretrain_config: CommOverlapConfig(tp_comm_overlap=True, userbuffers ...)
    "llama3_70b": ("--seq-length 8192 --overlap-grad-reduce --ddp-average-in-collective", True),
    # llama31_405b_pretrain_config: embedding and loss counted in the pipeline split;
    # set_llama31_common_configs: sequence 8192
    "llama31_405b": (
        "--seq-length 8192 --overlap-grad-reduce --ddp-average-in-collective "
        "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split",
        True,
    ),
    # recipes/deepseek/deepseek_v3.py + deepseek_llm_pretrain.py set_deepseek_v3_common_configs:
    # precision-aware optimizer (bf16 main grads and moments), router fusion, forced balanced
    # routing, experimental features on, selective recompute; comm_overlap.overlap_grad_reduce
    # False in the H100 function; CommOverlapConfig(tp_comm_overlap=False)
    "deepseek_v3": (
        "--seq-length 4096 --use-precision-aware-optimizer --main-grads-dtype bf16 "
        "--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 --moe-router-fusion "
        "--moe-router-force-load-balancing --enable-experimental --moe-token-dispatcher-type flex",
        False,
    ),
    # recipes/qwen/qwen3_moe.py + qwen3_llm_pretrain.py set_qwen3_common_configs (recompute off,
    # router fusion, forced balanced routing, sequence 4096); the H100 function sets
    # CommOverlapConfig(tp_comm_overlap=True) and the flex dispatcher
    "qwen3_30b_a3b": (
        "--seq-length 4096 --overlap-grad-reduce --moe-router-fusion "
        "--moe-router-force-load-balancing --moe-token-dispatcher-type flex",
        True,
    ),
    # the H100 function: CommOverlapConfig(tp_comm_overlap=False), dispatcher alltoall; the
    # recipe counts embedding and loss in the pipeline split
    "qwen3_235b_a22b": (
        "--seq-length 4096 --overlap-grad-reduce --moe-router-fusion "
        "--moe-router-force-load-balancing --moe-token-dispatcher-type alltoall "
        "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split",
        False,
    ),
    # recipes/nemotronh/nemotronh.py nemotronh_56b_pretrain_config; set_nemotronh_common_configs
    "nemotronh_56b": ("--seq-length 8192 --overlap-grad-reduce", True),
}
"""Per model: (its recipe's and family's settings as flags, whether TP communication overlap is
asked for)."""
PRECISION = {
    "bf16": "--bf16",
    "fp8_cs": "--bf16 --fp8-format hybrid --fp8-recipe tensorwise --fp8-param-gather",
}


def workloads(checkout: pathlib.Path, path: str) -> dict[str, dict]:
    """Every WorkloadBaseConfig constant of a workload_base_configs.py: name -> the fields set
    (WorkloadBaseConfig(...), dataclasses.replace(BASE, ...) and plain aliases)."""
    tree = ast.parse((checkout / CONFIGS / path).read_text())
    env: dict[str, dict] = {}
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)):
            continue
        name, value = node.targets[0].id, node.value
        if isinstance(value, ast.Name) and value.id in env:
            env[name] = dict(env[value.id])
        elif isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
            fields = {} if value.func.id == "WorkloadBaseConfig" else dict(env[value.args[0].id])  # type: ignore[attr-defined]
            fields.update({kw.arg: ast.literal_eval(kw.value) for kw in value.keywords})
            env[name] = fields
    return env


def workload_flags(w: dict, tp_overlap: bool) -> list[str]:
    """The workload base config's settings as flags (overrides.py set_workload_base_configs)."""
    tp, pp = w.get("tensor_model_parallel_size", 1), w.get("pipeline_model_parallel_size", 1)
    out = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    out += ["--context-parallel-size", str(w.get("context_parallel_size", 1))]
    out += ["--expert-model-parallel-size", str(w.get("expert_model_parallel_size", 1))]
    if w.get("expert_tensor_parallel_size") is not None:
        out += ["--expert-tensor-parallel-size", str(w["expert_tensor_parallel_size"])]
    if w.get("virtual_pipeline_model_parallel_size"):
        out += ["--num-virtual-stages-per-pipeline-rank"]
        out += [str(w["virtual_pipeline_model_parallel_size"])]
    out += ["--global-batch-size", str(w.get("global_batch_size", 1))]
    out += ["--micro-batch-size", str(w.get("micro_batch_size", 1))]
    out += ["--sequence-parallel"] if tp > 1 else []
    out += ["--tp-comm-overlap"] if tp_overlap and tp > 1 else []
    if w.get("use_megatron_fsdp"):
        out += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
    out += ["--use-nccl-ub"] if w.get("nccl_ub") else []
    if w.get("cuda_graph_impl"):
        out += ["--cuda-graph-impl", w["cuda_graph_impl"]]
        out += ["--cuda-graph-scope", *(w.get("cuda_graph_scope") or [])]
    if w.get("cpu_offloading_num_layers") is not None:
        out += ["--cpu-offloading-num-layers", str(w["cpu_offloading_num_layers"])]
    if w.get("recompute_num_layers") is not None:
        out += ["--recompute-granularity", "full", "--recompute-method", "block"]
        out += ["--recompute-num-layers", str(w["recompute_num_layers"])]
    if w.get("recompute_modules") is not None:
        out += ["--recompute-granularity", "selective", "--recompute-modules"]
        out += list(w["recompute_modules"])
    if w.get("moe_flex_dispatcher_backend"):
        out += ["--moe-flex-dispatcher-backend", w["moe_flex_dispatcher_backend"]]
    if w.get("moe_a2a_overlap"):
        out += ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"]
    if w.get("pp_layout"):
        out += ["--pipeline-model-parallel-layout", w["pp_layout"]]
    return out


def recipe_flags(checkout: pathlib.Path, model: str, precision: str) -> tuple[str, list[str], int]:
    """(workload constant name, the recipe's flags, its world size)."""
    name = f"{model.upper()}_PRETRAIN_CONFIG_H100_{precision.upper()}_V1"
    work = workloads(checkout, WORKLOADS[model])[name]
    settings, tp_overlap = FAMILY[model]
    argv = shlex.split(MODELS[model]) + shlex.split(settings) + shlex.split(COMMON)
    argv += shlex.split(PRECISION[precision]) + workload_flags(work, tp_overlap)
    return name, argv, int(work.get("num_gpus", 1))


def commit_of(checkout: pathlib.Path) -> str:
    """The checkout's commit."""
    done = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    return done.stdout.strip() or "unknown"


def main() -> None:
    """Write every recipe's flags."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("checkout", help="a Megatron-Bridge checkout at v0.3.1")
    ap.add_argument("--commit", default="", help="its commit (default: git rev-parse HEAD)")
    args = ap.parse_args()
    checkout = pathlib.Path(args.checkout)
    commit = args.commit or commit_of(checkout)
    OUT.mkdir(parents=True, exist_ok=True)
    for model, precision in RECIPES:
        name, argv, world = recipe_flags(checkout, model, precision)
        lines, current = [], []
        for word in argv:
            if word.startswith("--") and current:
                lines.append(shlex.join(current))
                current = []
            current.append(word)
        lines.append(shlex.join(current))
        header = (
            f"# NVIDIA-NeMo/Megatron-Bridge@{commit} (v0.3.1) {model}_pretrain_config_h100"
            f"(precision={precision!r}), workload {name}:\n# its Megatron settings as "
            f"pretrain_gpt.py flags (tests/data/extract_bridge_recipes.py); world size {world}\n"
        )
        (OUT / f"{model}_h100_{precision}.args").write_text(header + "\n".join(lines) + "\n")
        print(f"{model} {precision}: world size {world}")


if __name__ == "__main__":
    main()
