"""capture_megatron.train.dist_env: where a training process sits (torchrun's variables, Slurm's,
or a single process), and a single process's group of one, whose store is in memory (a free port
looked up first could be taken before the store listened on it: EADDRINUSE, seen in CI when
single-process references ran beside torchrun jobs)."""

from __future__ import annotations

import subprocess
import sys

from capture_megatron.train.dist_env import read_env


def test_torchrun_then_slurm_then_a_single_process():
    torchrun = read_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_PORT": "1234"})
    assert (torchrun.rank, torchrun.world_size, torchrun.local_rank) == (3, 4, 1)
    assert (torchrun.master_port, torchrun.source) == (1234, "torchrun")
    slurm = read_env(
        {"SLURM_PROCID": "2", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "1007",
         "SLURM_JOB_NODELIST": "gpu[03-05]"}
    )  # fmt: skip
    assert (slurm.rank, slurm.master_addr, slurm.master_port, slurm.source) == (
        2, "gpu03", 29507, "slurm"
    )  # fmt: skip
    single = read_env({})
    assert (single.world_size, single.master_port, single.source) == (1, 0, "single")
    assert read_env({"MASTER_PORT": "4321"}).master_port == 4321


def test_a_single_process_group_needs_no_port():
    code = (
        "import torch; from capture_megatron.train.dist_env import read_env, init_distributed\n"
        "print(init_distributed(read_env({})), type(torch.distributed.distributed_c10d"
        "._get_default_store().underlying_store).__name__)\n"
        "t = torch.ones(2); torch.distributed.all_reduce(t); print(t.tolist())\n"
        # as a run does at its end: a gloo group left to the interpreter's teardown can abort it
        # ('terminate called without an active exception', seen in CI)
        "torch.distributed.destroy_process_group()"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == ["gloo HashStore", "[1.0, 1.0]"]
