"""Write the pretrain_gpt.py command lines of NVIDIA's Megatron MoE Model Zoo benchmarking configs
(github.com/yanring/Megatron-MoE-ModelZoo, Apache-2.0) as tests/data/moe_modelzoo/<MODEL>.args.

    git clone https://github.com/yanring/Megatron-MoE-ModelZoo
    git -C Megatron-MoE-ModelZoo checkout e8650517d60d71ab73fc6b3b0388cac4ba435181
    python tests/data/extract_moe_modelzoo.py Megatron-MoE-ModelZoo

Each line is what `MODEL=<name> bash sbatch_benchmarking.sh` (DRY_RUN=1 prints it) passes to
pretrain_gpt.py with the repository's defaults, done here step by step as the script does it:
- runtime_configs/benchmarking/runtime.conf: the model's TP PP EP CP VPP MBS GBS LAYERS
  DISPATCHER GROUPED_GEMM NNODES ... SEQ_LEN [PP_FIRST PP_LAST] row; LAYERS_PER_VP is
  LAYERS / PP / VPP when VPP > 1, else false; PP_FIRST / PP_LAST only when PP does not divide the
  layers;
- model_configs/benchmarking/<MODEL>.yaml's MODEL_ARGS after envsubst (unset variables become
  empty; the paths and names the cluster config sets become /data/... placeholders), then the
  script's yq rule: a value `false` drops the flag, `true` makes it a switch, any other value
  follows the flag;
- the script's additions with its defaults: --num-virtual-stages-per-pipeline-rank VPP when
  VPP > 1 and no layout / layers-per-virtual-stage flag is given, --decoder-first / last-pipeline-
  num-layers when PP does not divide the layers, DISPATCHER=deepep (--moe-token-dispatcher-type
  flex --moe-flex-dispatcher-backend deepep), PR=bf16 (--tp-comm-overlap), and
  --max-position-embeddings SEQ_LEN when SEQ_LEN exceeds the config's.
The world size is NNODES x 8 (N_TASKS_PER_NODE on H100 clusters). tests/data/moe_modelzoo/
README.md lists them.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shlex
import subprocess

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "data" / "moe_modelzoo"
MODELS = (
    "Mixtral-8x7B",
    "Mixtral-8x22B",
    "DeepSeek-V2-Lite",
    "DeepSeek-V3",
    "Qwen3-30B-A3B",
    "Qwen3-235B-A22B",
)
COLUMNS = "TP PP EP CP VPP MBS GBS LAYERS DISPATCHER GROUPED_GEMM NNODES RUN_TIME PRETRAIN SLEN"
PLACEHOLDERS = {
    "WORKSPACE": "/data/moe_modelzoo",
    "OUTPUT_PATH": "/data/moe_modelzoo/output",
    "DATA_PATH": "/data/moe_modelzoo/my_text_document",
    "TOKENIZER_MODEL": "/data/moe_modelzoo/tokenizer.model",
    "LOAD_PATH": "/data/moe_modelzoo/checkpoint",
    "WANDB_PROJECT": "moe-benchmarking",
    "COMMENT": "benchmarking",
}
"""What the cluster config (cluster_configs/benchmarking/template.conf: YOUR_... values) and
common.conf set, replaced by placeholders."""


def runtime_row(zoo: pathlib.Path, model: str) -> dict[str, str]:
    """The model's row of runtime.conf's BENCHMARKING_MODEL_CONFIGS, by column name."""
    text = (zoo / "runtime_configs" / "benchmarking" / "runtime.conf").read_text()
    line = re.search(rf'\[{re.escape(model)}\]="([^"]*)"', text)
    if line is None:
        raise SystemExit(f"{model}: no row in runtime.conf")
    values = line.group(1).split()
    names = COLUMNS.split() + ["DATASET", "PP_FIRST", "PP_LAST"]
    return dict(zip(names, values))


def environment(row: dict[str, str]) -> dict[str, str]:
    """The variables envsubst sees (runtime.conf's set_model_configs, then the placeholders)."""
    env = {k: row[k] for k in ("TP", "PP", "EP", "CP", "VPP", "MBS", "GBS")}
    layers, pp, vpp = int(row["LAYERS"]), int(row["PP"]), int(row["VPP"])
    env["NUM_LAYERS"] = row["LAYERS"]
    env["MOE_TOKEN_DISPATCHER"] = row["DISPATCHER"]
    env["MOE_GROUPED_GEMM"] = row["GROUPED_GEMM"]
    env["SEQ_LEN"] = row["SLEN"]
    env["LAYERS_PER_VP"] = str(layers // pp // vpp) if vpp > 1 else "false"
    uneven = layers % pp != 0
    env["PP_FIRST"] = row.get("PP_FIRST", "false") if uneven else "false"
    env["PP_LAST"] = row.get("PP_LAST", "false") if uneven else "false"
    return {**env, **PLACEHOLDERS}


def envsubst(text: str, env: dict[str, str]) -> str:
    """${VAR} and $VAR replaced as envsubst does (unset: empty)."""
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m.group(1) or m.group(2), ""), text)


def model_args(zoo: pathlib.Path, model: str, env: dict[str, str]) -> list[str]:
    """MODEL_ARGS of the model's YAML after envsubst, by the script's yq rule."""
    raw = (zoo / "model_configs" / "benchmarking" / f"{model}.yaml").read_text()
    config = yaml.safe_load(envsubst(raw, env))
    argv: list[str] = []
    for key, value in config["MODEL_ARGS"].items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        if text == "false":
            continue
        argv += [key] if text == "true" else [key, *shlex.split(text)]
    return argv


def additions(argv: list[str], row: dict[str, str], env: dict[str, str]) -> list[str]:
    """What sbatch_benchmarking.sh appends with its defaults (see the module docstring)."""
    out: list[str] = []
    joined = " ".join(argv)
    layout_given = any(
        f in joined
        for f in (
            "--pipeline-model-parallel-layout",
            "--num-virtual-stages-per-pipeline-rank",
            "--num-layers-per-virtual-pipeline-stage",
        )
    )
    if int(row["VPP"]) > 1 and not layout_given:
        out += ["--num-virtual-stages-per-pipeline-rank", row["VPP"]]
    if int(row["LAYERS"]) % int(row["PP"]) and "--pipeline-model-parallel-layout" not in joined:
        out += ["--decoder-first-pipeline-num-layers", env["PP_FIRST"]]
        out += ["--decoder-last-pipeline-num-layers", env["PP_LAST"]]
    out += ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "deepep"]
    out += ["--tp-comm-overlap"]  # PR=bf16
    if "--max-position-embeddings" in argv:
        positions = int(argv[argv.index("--max-position-embeddings") + 1])
        if int(row["SLEN"]) > positions:
            out += ["--max-position-embeddings", row["SLEN"]]
    return out


def commit_of(zoo: pathlib.Path) -> str:
    """The checkout's commit."""
    done = subprocess.run(
        ["git", "-C", str(zoo), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    return done.stdout.strip() or "unknown"


def write(zoo: pathlib.Path, model: str, commit: str) -> int:
    """Write one model's .args file; returns its world size."""
    row = runtime_row(zoo, model)
    env = environment(row)
    argv = model_args(zoo, model, env)
    argv += additions(argv, row, env)
    world = int(row["NNODES"]) * 8
    lines, current = [], []
    for word in argv:
        if word.startswith("--") and current:
            lines.append(shlex.join(current))
            current = []
        current.append(word)
    lines.append(shlex.join(current))
    header = (
        f"# yanring/Megatron-MoE-ModelZoo@{commit} MODEL={model} bash sbatch_benchmarking.sh:\n"
        f"# the pretrain_gpt.py flags with the repository's defaults (tests/data/"
        f"extract_moe_modelzoo.py); world size {world}\n"
    )
    (OUT / f"{model}.args").write_text(header + "\n".join(lines) + "\n")
    return world


def main() -> None:
    """Write every model's flags."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("zoo", help="a Megatron-MoE-ModelZoo checkout")
    args = ap.parse_args()
    zoo = pathlib.Path(args.zoo)
    os.makedirs(OUT, exist_ok=True)
    commit = commit_of(zoo)
    for model in MODELS:
        print(f"{model}: world size {write(zoo, model, commit)}")


if __name__ == "__main__":
    main()
