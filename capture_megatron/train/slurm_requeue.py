"""`capture-megatron launch --requeue`: the batch-script parts that save before the time limit and
requeue the job. Pure Python.

How it works (the pieces are Slurm's and Megatron-LM's own):
- `#SBATCH --signal=B:USR1@LEAD` has Slurm send SIGUSR1 to the batch shell LEAD seconds before the
  time limit; `#SBATCH --requeue` makes the job requeueable (Slurm also requeues it after a node
  failure); `--open-mode=append` keeps every start's output in one file.
- The shell runs srun in the background and traps USR1: it passes the signal to srun, which
  forwards it to every process of the step, i.e. to each rank.
- The ranks run with `--exit-signal-handler --exit-signal SIGUSR1` (Megatron-LM's flags,
  capture_megatron.train.exit_signal): they finish the iteration, save a checkpoint to --save and
  exit 0. torchrun itself is started with SIGUSR1 ignored (`trap "" USR1` before exec), so it does
  not die of the signal and ends normally once its workers have; a rank ignores the signal too
  until it installs its handler.
- The shell then requeues the job (`scontrol requeue`) when the checkpoint advanced and is short of
  --train-iters. Every start loads from --save once it holds a checkpoint, else from --load.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

TRACKER = "latest_checkpointed_iteration.txt"
"""The file in --save naming the newest complete checkpoint
(capture_megatron.train.checkpoint.save_load)."""
IGNORE_USR1 = 'bash -c \'trap "" USR1; exec "$0" "$@"\' '
"""Prefix of the srun command: the launched process starts with SIGUSR1 ignored."""


@dataclass(frozen=True)
class RequeueParts:
    """The pieces a template puts around its srun command under --requeue."""

    prefix: str
    """Before the launched program on the srun line (start with SIGUSR1 ignored)."""
    load_arg: str
    """Appended to pretrain_gpt's flags: --load from the directory chosen at start."""
    before: str
    """Shell lines before srun: where to resume from, and the trap."""
    after: str
    """Shell lines after srun (started in the background): wait, then requeue or exit."""


def sbatch_lines(lead: int) -> list[str]:
    """The #SBATCH lines --requeue adds."""
    return ["#SBATCH --requeue", f"#SBATCH --signal=B:USR1@{lead}", "#SBATCH --open-mode=append"]


def _before(lead: int, save_dir: str, load_dir: str) -> str:
    save, load = shlex.quote(save_dir), shlex.quote(load_dir or save_dir)
    return f"""
# --requeue: Slurm sends SIGUSR1 to this script {lead} s before the time limit; the trap passes it
# to the ranks (srun forwards it to every process of the step), which finish their iteration, save
# a checkpoint to --save and exit; then the job requeues itself and the next start resumes from it.
SAVE={save}
TRACKER="$SAVE/{TRACKER}"
CKPT_LOAD={load}
if [ -f "$TRACKER" ]; then CKPT_LOAD="$SAVE"; fi
START_ITER="$(cat "$TRACKER" 2>/dev/null || echo 0)"
echo "capture-megatron: start ${{SLURM_RESTART_COUNT:-0}} of job $SLURM_JOB_ID, from iteration \
$START_ITER (--load $CKPT_LOAD)"
signalled=0
step=""
on_signal() {{
  signalled=1
  echo "capture-megatron: SIGUSR1, the time limit is near: the ranks save a checkpoint and exit"
  if [ -n "$step" ]; then kill -USR1 "$step" 2>/dev/null || true; fi
}}
trap on_signal USR1
"""


def _after(iters: int) -> str:
    return f"""step=$!
rc=0
wait "$step" || rc=$?
# the trap interrupts `wait`: wait again until srun has ended
while kill -0 "$step" 2>/dev/null; do rc=0; wait "$step" || rc=$?; done
LAST_ITER="$(cat "$TRACKER" 2>/dev/null || echo 0)"
if [ "$signalled" = 1 ] && [ "$LAST_ITER" -lt {iters} ]; then
  if [ "$LAST_ITER" -gt "$START_ITER" ]; then
    echo "capture-megatron: checkpoint at iteration $LAST_ITER of {iters}: requeueing job \
$SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
  fi
  echo "capture-megatron: no checkpoint after iteration $START_ITER was saved before the time \
limit: not requeueing (raise --time or --signal-seconds)" >&2
fi
exit "$rc"
"""


def parts(lead: int, train_iters: int, save: str, load: str) -> RequeueParts:
    """The --requeue pieces for a job signalled `lead` seconds before its limit that trains to
    `train_iters`, saving to `save` and first loading from `load` (empty: `save`)."""
    return RequeueParts(
        prefix=IGNORE_USR1,
        load_arg=' \\\n    --load "$CKPT_LOAD"',
        before=_before(lead, save, load),
        after=_after(train_iters),
    )
