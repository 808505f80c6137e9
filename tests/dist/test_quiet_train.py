"""`capture-megatron train` prints per rank no megatron-core warning that does not concern the
user (Apex / Transformer Engine fallbacks, the implicit rerun state machine, deprecated scopes),
and says instead in its header which spec and kernels run."""

from __future__ import annotations

from harness import cli


def test_train_prints_its_header_and_no_megatron_warnings(tmp_path):
    model = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
        "--max-position-embeddings 64 --vocab-size 512 --micro-batch-size 2 --global-batch-size 4"
    )
    done = cli(
        ["train", "--nproc", "2", *model.split()]
        + "--train-iters 2 --mock-data --pipeline-model-parallel-size 2 --no-progress".split(),
        cwd=str(tmp_path),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    header = done.stdout.splitlines()[0]
    assert header.endswith(
        "| local spec on cpu (no Transformer Engine or Apex: torch norms and optimizers)"
    ), header
    warned = ("Warning", "warnings.warn", "WARNING", "Rerun State Machine", "RerunStateMachine")
    assert not [w for w in warned if w in done.stdout + done.stderr], done.stderr[-3000:]
