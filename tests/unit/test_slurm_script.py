"""The text of the batch script `capture-megatron launch` renders (capture_megatron.train.slurm):
CPUs per task, whole nodes or memory, pyxis container flags, requeue on a signal before the time
limit with --load from the newest checkpoint, and the warning when the cost model's run time exceeds
--time. Slurm itself checks these scripts in tests/slurm (sbatch --test-only and real jobs)."""

from __future__ import annotations

import subprocess

import pytest
from test_cli_errors import cli, one_error

from capture_megatron.cli.launch import SIGNAL, _requeue_run, _time_note, build_parser
from capture_megatron.config import CheckpointOptions, ParallelPlan, RunOptions
from capture_megatron.config.presets import preset
from capture_megatron.errors import CaptureError
from capture_megatron.flags import parser as flags
from capture_megatron.train.slurm import SlurmOptions, TrainRun, render
from capture_megatron.train.slurm_time import duration, run_time_warning, time_limit_seconds

ARGS = ("--num-layers", "32", "--train-iters", "500", "--save", "/ckpt/run")


def _script(per_node: int = 8, run: TrainRun | None = None, **opts) -> str:
    options = SlurmOptions(**{"nodes": 16, "sbatch": "job.sh", **opts})
    return render(options, per_node, run or TrainRun(args=ARGS, tp=8))


def _srun(text: str) -> str:
    """The srun command, continuation lines joined."""
    joined = text.replace("\\\n", " ")
    return next(line for line in joined.splitlines() if line.startswith("srun "))


@pytest.mark.parametrize(
    "opts, per_node, cpus",
    [
        ({}, 8, 64),  # torchrun: one task runs the node's 8 GPU ranks, 8 CPUs each
        ({"mode": "tasks"}, 8, 8),  # one task per GPU rank
        ({"cpu": True}, 4, 8),  # 4 CPU ranks under torchrun, 2 CPUs each
        ({"cpu": True, "mode": "tasks"}, 4, 2),
        ({"cpus_per_task": 96}, 8, 96),  # given: used as is
    ],
)
def test_cpus_per_task_cover_the_ranks_of_a_task(opts, per_node, cpus):
    text = _script(per_node, **opts)
    assert f"#SBATCH --cpus-per-task={cpus}\n" in text
    # srun does not inherit sbatch's --cpus-per-task (Slurm >= 22.05): it is repeated there
    assert f"--cpus-per-task={cpus} " in _srun(text)


def test_whole_nodes_with_all_their_memory_by_default():
    text = _script()
    assert "#SBATCH --exclusive\n" in text and "#SBATCH --mem=0\n" in text


@pytest.mark.parametrize(
    "opts, lines, absent",
    [
        ({"exclusive": False}, [], ["--exclusive", "--mem"]),
        ({"exclusive": False, "mem": "64G"}, ["#SBATCH --mem=64G"], ["--exclusive"]),
        ({"mem": "500G"}, ["#SBATCH --exclusive", "#SBATCH --mem=500G"], ["--mem=0"]),
    ],
)
def test_shared_nodes_and_given_memory(opts, lines, absent):
    text = _script(**opts)
    assert all(line + "\n" in text for line in lines)
    assert not any(a in text for a in absent)


def test_container_flags_go_on_srun():
    text = _script(
        container_image="nvcr.io/nvidia/pytorch:25.01-py3",
        container_mounts="/lustre/data:/data,/lustre/ckpt:/ckpt:rw",
        container_workdir="/workspace",
    )
    srun = _srun(text)
    for flag in (
        "--container-image=nvcr.io/nvidia/pytorch:25.01-py3",
        "--container-mounts=/lustre/data:/data,/lustre/ckpt:/ckpt:rw",
        "--container-workdir=/workspace",
    ):
        assert flag in srun and "#SBATCH " + flag not in text
    assert "--container" not in _srun(_script())


@pytest.mark.parametrize(
    "opts, message",
    [
        ({"container_mounts": "/data:/data"}, "--container-mounts needs --container-image"),
        ({"container_workdir": "/w"}, "--container-workdir needs --container-image"),
        ({"mem": "lots"}, "--mem 'lots' is not a Slurm size"),
        ({"time": "2 hours"}, "--time '2 hours' contains a space"),
        ({"time": "1:2:3:4"}, "--time '1:2:3:4' is not a Slurm time limit"),
        ({"cpus_per_task": -1}, "--cpus-per-task -1 must be >= 0"),
        ({"signal_seconds": 120}, "--signal-seconds 120 needs --requeue"),
        ({"requeue": True, "time": "00:05:00"}, "--signal-seconds 300 leaves no time to train"),
        ({"requeue": True, "signal_seconds": 70000}, "must be between 1 and 65535"),
    ],
)
def test_bad_job_settings_are_refused(opts, message):
    with pytest.raises(CaptureError, match="invalid Slurm job") as err:
        SlurmOptions(nodes=1, sbatch="job.sh", **opts)
    assert message in str(err.value)


def _requeue_script(mode: str, load: str = "") -> str:
    run = TrainRun(args=ARGS, tp=8, train_iters=500, save="/ckpt/run", load=load)
    return _script(run=run, mode=mode, requeue=True, signal_seconds=600)


@pytest.mark.parametrize("mode", ["torchrun", "tasks"])
def test_requeue_signals_saves_and_resumes(mode, tmp_path):
    text = _requeue_script(mode)
    for line in ("#SBATCH --requeue", "#SBATCH --signal=B:USR1@600", "#SBATCH --open-mode=append"):
        assert line + "\n" in text
    srun = _srun(text)
    assert srun.rstrip().endswith('--load "$CKPT_LOAD" &')  # in the background: the trap runs
    assert 'bash -c \'trap "" USR1; exec "$0" "$@"\' ' in srun  # launcher ignores USR1
    assert "trap on_signal USR1" in text and 'kill -USR1 "$step"' in text
    assert "CKPT_LOAD=/ckpt/run\n" in text and 'CKPT_LOAD="$SAVE"' in text
    assert '[ "$LAST_ITER" -lt 500 ]' in text and 'scontrol requeue "$SLURM_JOB_ID"' in text
    script = tmp_path / "job.sh"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_first_start_loads_the_given_load_then_save():
    text = _requeue_script("torchrun", load="/ckpt/pretrained")
    assert "CKPT_LOAD=/ckpt/pretrained\n" in text and "SAVE=/ckpt/run\n" in text


def test_without_requeue_srun_runs_in_the_foreground():
    text = _script()
    assert "--requeue" not in text and "--signal" not in text and "trap" not in text
    assert not _srun(text).rstrip().endswith("&") and "CKPT_LOAD" not in text


def _requeue_options(**ckpt) -> tuple[SlurmOptions, CheckpointOptions]:
    return SlurmOptions(nodes=1, sbatch="j.sh", requeue=True), CheckpointOptions(**ckpt)


def test_requeue_turns_on_megatrons_exit_signal_handler():
    opts, ckpt = _requeue_options(save="/ckpt")
    run = _requeue_run(opts, RunOptions(), ckpt, [])
    assert run.exit_signal_handler and run.exit_signal == SIGNAL == "SIGUSR1"


@pytest.mark.parametrize(
    "ckpt, argv, message",
    [
        ({}, [], "--requeue needs --save DIR"),
        ({"save": "/c", "finetune": True}, [], "--finetune would apply to every requeued start"),
        ({"save": "/c", "no_load_optim": True}, [], "--no-load-optim would apply"),
        ({"save": "/c", "load": "/c", "ckpt_step": 4}, [], "--ckpt-step would apply"),
        ({"save": "/c"}, ["--exit-signal", "SIGTERM"], "--exit-signal SIGTERM: --requeue signals"),
    ],
)
def test_requeue_refuses_what_would_lose_progress(ckpt, argv, message):
    opts, options = _requeue_options(**ckpt)
    run = RunOptions(exit_signal=argv[1]) if argv else RunOptions()
    with pytest.raises(CaptureError, match="invalid --requeue job") as err:
        _requeue_run(opts, run, options, argv)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("90", 5400),
        ("90:30", 5430),
        ("04:00:00", 14400),
        ("2-00", 172800),
        ("1-12:30", 131400),
        ("1-00:00:10", 86410),
        ("UNLIMITED", None),
        ("infinite", None),
    ],
)
def test_slurm_time_formats(text, seconds):
    assert time_limit_seconds(text) == seconds


def test_run_time_warning_only_when_the_estimate_exceeds_the_limit():
    assert run_time_warning(2.0, 1000, "01:00:00", None, "GPU") == ""  # 33 min
    assert run_time_warning(2.0, 1000, "UNLIMITED", None, "GPU") == ""
    text = run_time_warning(2.0, 10000, "02:00:00", None, "GPU")
    assert text.startswith("the cost model estimates 5 h 33 min for the 10000 iterations (2 s")
    assert "killed at the time limit" in text and "add --requeue" in text
    again = run_time_warning(2.0, 10000, "02:00:00", 300, "GPU")
    assert "saves a checkpoint 300 s before each limit" in again
    assert "about 3 runs of the job" in again  # 20000 s over 6900 s of training per run
    assert duration(45) == "45 s" and duration(3 * 86400) == "3.0 days"


def test_launch_warns_in_the_script_when_the_run_outlasts_time():
    shape = preset("llama3-8b")
    plan = ParallelPlan(
        tp=8, pp=4, dp=4, micro_batch_size=1, global_batch_size=512, layers_per_stage=(8,) * 4
    )
    opts = SlurmOptions(nodes=16, sbatch="j.sh", time="02:00:00")
    ns = build_parser().parse_args(["--nodes", "16", "--sbatch", "j.sh", "--time", "02:00:00"])
    note = _time_note(ns, shape, plan, opts, 2000)
    assert note.startswith("the cost model estimates") and "--time 02:00:00" in note
    assert "s per step on h100-sxm" in note  # the --gpu-type's profile, as plan / predict print
    assert _time_note(ns, shape, plan, opts, 10) == ""
    ns.gpu_type = "b200"  # a faster GPU: the same run fits the limit
    assert _time_note(ns, shape, plan, opts, 1000) == ""
    ns.gpu_type = "h100-sxm"
    assert _time_note(ns, shape, plan, opts, 1000) != ""
    cpu = SlurmOptions(nodes=16, sbatch="j.sh", time="02:00:00", cpu=True)
    assert _time_note(ns, shape, plan, cpu, 2000) == ""  # the cost model describes GPUs
    text = _script(run=TrainRun(args=ARGS, tp=8, notes=(note,)))
    assert text.splitlines()[2].startswith("# WARNING: the cost model estimates")
    assert text.index("# WARNING") < text.index("#SBATCH")


def test_launch_refuses_requeue_without_save_before_planning(tmp_path):
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
    argv += ["--nodes", "1", "--gpus-per-node", "4", "--cpu", "--requeue"]
    line = one_error(cli(["launch", *argv, "--sbatch", "job.sh"], str(tmp_path)), "launch")
    assert "--requeue needs --save DIR" in line and not (tmp_path / "job.sh").exists()


@pytest.mark.parametrize(
    "argv, exclusive, mem",
    [([], True, "0"), (["--exclusive"], True, "0"), (["--no-exclusive"], False, "")],
)
def test_exclusive_is_the_default_and_can_be_turned_off(argv, exclusive, mem):
    ns = build_parser().parse_args(["--nodes", "2", "--sbatch", "j.sh", *argv])
    opts = flags.from_namespace(SlurmOptions, ns)
    assert (opts.exclusive, opts.memory()) == (exclusive, mem)
