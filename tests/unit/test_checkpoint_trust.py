"""The byte items of a torch_dist checkpoint (this project's RNG states are saved as ShardedObjects)
are read with torch.load(weights_only=True) once train.checkpoint.trust is installed: torch's
DefaultLoadPlanner would unpickle them in full and run what a crafted checkpoint holds. A fresh
process (it initialises torch.distributed); the end-to-end refusals of a crafted ``.metadata`` and
``common.pt`` are in tests/dist/test_checkpoint_integrity.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import os, sys, tempfile
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from capture_megatron.emulate import cpu_compat

    cpu_compat.apply("cpu")

    class RunsCode:
        def __reduce__(self):
            return (os.system, ("touch " + sys.argv[1],))

    work = tempfile.mkdtemp()
    store = dist.FileStore(os.path.join(work, "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    ckpt = os.path.join(work, "ckpt")
    os.makedirs(ckpt)
    dist_checkpointing.save({"rng_state": ShardedObject("rng_state", RunsCode(), (1,), (0,))}, ckpt)
    if sys.argv[2] == "safe":
        from capture_megatron.train.checkpoint import trust as ckpt_safe
        ckpt_safe.install()
    template = {"rng_state": ShardedObject("rng_state", None, (1,), (0,))}
    try:
        dist_checkpointing.load(template, ckpt)
        print("loaded")
    except BaseException as err:  # torch's CheckpointException is a BaseException
        print("refused", type(err).__name__)
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_byte_items_are_read_weights_only(tmp_path):
    marker = tmp_path / "pwned"
    runs = {}
    for mode in ("stock", "safe"):
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(marker), mode],
            capture_output=True,
            text=True,
            timeout=300,
        )
        runs[mode] = (done.stdout.strip().splitlines() or [""])[-1], marker.exists()
        marker.unlink(missing_ok=True)
    # without it, loading runs the crafted object's command (torch.load, weights_only=False)
    assert runs["stock"] == ("loaded", True)
    assert runs["safe"][1] is False and runs["safe"][0].startswith("refused"), runs
