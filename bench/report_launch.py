"""The "starting a CPU job" section of docs/BENCHMARKS.md (from bench/results/rank_start.json,
written by bench/rank_start.py; see bench/report.py)."""

from __future__ import annotations

from report_results import read_result


def rank_start_section(root: str) -> str:
    """The table of exec'd against forked CPU ranks, or nothing before the bench has run."""
    data = read_result(root, "rank_start")
    if data is None:
        return ""
    out = [
        "\n\n## Starting a CPU training job: ranks as Pythons of their own or forked "
        "(bench/rank_start.py)\n",
        "A tiny GPT (4 layers, hidden 64, PP = ranks, 2 iterations on mock data) under torchrun. "
        "*exec*: `torchrun -m capture_megatron.pretrain_gpt`, each rank importing torch and "
        "megatron-core (GPU machines, the Slurm scripts); *fork*: `train.preloaded`, torchrun's "
        "`--start-method fork --run-path` after one import (`capture-megatron train`, `verify` "
        "and `demo` without CUDA). CPU is the job's and everything it started; medians of "
        f"{data['rows'][0]['repeats']} runs each, alternating; every pair's losses and per-rank "
        f"peaks equal. {data['machine']}, 5-minute load average "
        f"{data['load_average_5min']:.1f}.\n",
        "| ranks | exec wall s | fork wall s | exec CPU s | fork CPU s | CPU saved |",
        "|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        saved = 100 * (1 - r["fork_cpu_s"] / r["exec_cpu_s"])
        out.append(
            f"| {r['ranks']} | {r['exec_wall_s']} | {r['fork_wall_s']} | {r['exec_cpu_s']} | "
            f"{r['fork_cpu_s']} | {saved:.0f}% |"
        )
    return "\n".join(out) + "\n"
