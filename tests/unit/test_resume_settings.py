"""What else a resume may change (train.resume_settings, issue 56): precision is refused while the
optimizer is loaded, Adam's betas and epsilon are this run's again after the load and named, and
every other setting that changes the model's function, the gradients or the data is named -- on
checkpoints' common state as save_checkpoint writes it (and as older ones hold it)."""

from __future__ import annotations

import dataclasses

import pytest

from capture_megatron.config import (
    BuildOptions,
    DataOptions,
    ModelShape,
    OptimOptions,
    ParallelPlan,
    RunOptions,
    TrainConfig,
)
from capture_megatron.config.training import CheckpointOptions
from capture_megatron.errors import CaptureError
from capture_megatron.megatron.schedule import schedule
from capture_megatron.train import resume
from capture_megatron.train.resume import SavedRun
from capture_megatron.train.resume_settings import saved_settings

SHAPE = ModelShape(
    num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=257
)
PLAN = ParallelPlan(
    tp=1, pp=1, dp=1, micro_batch_size=1, global_batch_size=4, layers_per_stage=(2,)
)


def _cfg(shape=SHAPE, plan=PLAN, optim=None, data=None, seed=7, **checkpoint):
    return TrainConfig(
        shape=shape,
        plan=plan,
        optim=optim or OptimOptions(),
        data=data or DataOptions(mock_data=True),
        checkpoint=CheckpointOptions(load="ckpt", **checkpoint),
        run=RunOptions(train_iters=6, seed=seed),
        build=BuildOptions(),
    )


def _common(cfg: TrainConfig, recorded: bool = True) -> dict:
    """The common state a save of `cfg` writes (`recorded` False: one written before the
    settings were recorded)."""
    optim = cfg.optim
    group = {"betas": (optim.adam_beta1, optim.adam_beta2), "eps": optim.adam_eps, "lr": 0.0}
    sched = dataclasses.asdict(schedule(optim, cfg.run.train_iters, 4))
    common = {
        "shape": cfg.shape.to_json(),
        "plan": cfg.plan.to_json(),
        "opt_param_scheduler": {**sched, "num_steps": 24},
        "optimizer": {"param_groups": [group, dict(group)], "state": {}},
        "iteration": 6,
    }
    return {**common, **saved_settings(cfg)} if recorded else common


def _notes(saved: TrainConfig, current: TrainConfig, recorded: bool = True) -> str:
    common = _common(saved, recorded)
    run_schedule = schedule(current.optim, current.run.train_iters, 4)
    notes = resume.check_resume(SavedRun.from_common("ck", common), common, current, run_schedule)
    assert len(notes) <= 1 and all("\n" not in n for n in notes)
    return notes[0] if notes else ""


def test_an_unchanged_resume_says_nothing():
    assert _notes(_cfg(), _cfg()) == ""
    assert _notes(_cfg(), _cfg(), recorded=False) == ""


def test_another_precision_is_refused_while_the_optimizer_loads():
    with pytest.raises(CaptureError) as err:
        _notes(_cfg(), _cfg(shape=SHAPE.replace(dtype="bf16")))
    text = str(err.value)
    assert "the checkpoint was trained in fp32 and this run is bf16" in text
    assert "Resume in fp32, or give --no-load-optim" in text
    weights_only = _notes(_cfg(), _cfg(shape=SHAPE.replace(dtype="bf16"), no_load_optim=True))
    assert "the checkpoint's fp32 weights are converted to bf16" in weights_only


@pytest.mark.parametrize("recorded", [True, False])
def test_adam_hyperparameters_are_this_runs_and_named(recorded):
    text = _notes(_cfg(), _cfg(optim=OptimOptions(adam_beta2=0.95, adam_eps=1e-6)), recorded)
    assert "this run changes what the checkpoint was trained with, from iteration 7 on" in text
    assert "--adam-beta2 0.999 in the checkpoint, 0.95 here (this run's, set again" in text
    assert "--adam-eps 1e-08 in the checkpoint, 1e-06 here" in text
    assert "--adam-beta1" not in text


BUCKETS = dataclasses.replace(PLAN, ddp=dataclasses.replace(PLAN.ddp, ddp_bucket_size=4096))
CHANGES = {
    "dropout": ({"shape": SHAPE.replace(hidden_dropout=0.0)}, "--hidden-dropout 0.1 in the"),
    "seq-length": (
        {"shape": SHAPE.replace(seq_length=16, max_position_embeddings=32)},
        "--seq-length 32 in the checkpoint, 16 here",
    ),
    "norm-epsilon": ({"shape": SHAPE.replace(norm_epsilon=1e-6)}, "--norm-epsilon 1e-05 in the"),
    "clip-grad": ({"optim": OptimOptions(clip_grad=0.5)}, "--clip-grad 1.0 in the checkpoint, 0.5"),
    "seed": ({"seed": 8}, "--seed 7 in the checkpoint, 8 here"),
    "split": ({"data": DataOptions(mock_data=True, split="90,5,5")}, "--split 969,30,1 in the"),
    "ddp-bucket": ({"plan": BUCKETS}, "--ddp-bucket-size not given in the checkpoint, 4096 here"),
}


@pytest.mark.parametrize("change, words", CHANGES.values(), ids=CHANGES.keys())
def test_every_other_change_is_named(change, words):
    assert words in _notes(_cfg(), _cfg(**change))


def test_a_checkpoint_without_recorded_settings_is_compared_on_what_it_holds():
    text = _notes(_cfg(), _cfg(seed=8, shape=SHAPE.replace(attention_dropout=0.0)), False)
    assert "--attention-dropout 0.1 in the checkpoint, 0.0 here" in text
    assert "--seed" not in text  # not recorded: nothing to compare with


def test_the_refused_changes_stay_refused():
    with pytest.raises(CaptureError, match="--hidden-size 64 in the checkpoint, 128 here"):
        _notes(_cfg(), _cfg(shape=SHAPE.replace(hidden_size=128)))
    with pytest.raises(CaptureError, match="peak learning rate"):
        _notes(_cfg(), _cfg(optim=OptimOptions(lr=3e-4)))
