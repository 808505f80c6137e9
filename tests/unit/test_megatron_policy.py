"""Every flag of Megatron-LM's pretrain_gpt.py (the installed megatron-core's series: core_v0.16.1
or core_v0.19.0; both tables are classified) is known: declared by one of
capture-megatron's option classes, or ignored (it cannot change memory), or refused by name when it
changes memory in a way not modelled -- and `plan` / `predict` parse each of them."""

from __future__ import annotations

import pytest

from capture_megatron.cli.plan import build_parser as plan_parser
from capture_megatron.cli.predict import build_parser as predict_parser
from capture_megatron.errors import CaptureError
from capture_megatron.flags import megatron_lm
from capture_megatron.flags import parser as flags
from capture_megatron.rules import flags as policy
from capture_megatron.rules.flags import activation_offload_problem

OURS = {name for name in predict_parser()._option_string_actions} - megatron_lm.flag_names()


def _declared_by_us() -> set[str]:
    p = flags.FlagParser()
    flags.add_model_flags(p)
    flags.add_kernel_flags(p)
    flags.add_parallel_flags(p)
    flags.add_training_flags(p)
    flags.add_fields(p, flags.DataOptions)
    flags.add_checkpoint_flags(p)
    return set(p._option_string_actions)


@pytest.mark.parametrize("series", sorted(megatron_lm.TABLES), ids=str)
def test_every_megatron_flag_is_classified_once(series):
    ours = _declared_by_us()
    missing, twice = [], []
    for arg in megatron_lm.arguments(series):
        name = arg.flags[0]
        kinds = [
            bool(ours & set(arg.flags)),
            policy.ignored(*arg.flags),
            policy.unmodelled_reason(*arg.flags) is not None,
        ]
        if sum(kinds) == 0:
            missing.append(name)
        if kinds[1] and kinds[2] or (kinds[0] and (kinds[1] or kinds[2]) and name not in ours):
            twice.append(name)
    assert missing == [] and twice == []


def test_policy_names_only_megatron_flags():
    known = megatron_lm.all_flag_names()  # of any series: 0.16-only flags stay classified
    named = policy.IGNORED | set(policy.UNMODELLED) | set(policy.IGNORED_REASONS)
    named |= set(policy.RULES)
    assert sorted(f for f in named if f not in known) == []


@pytest.mark.parametrize("build", [plan_parser, predict_parser])
def test_every_megatron_flag_parses(build):
    parser = build()
    for arg in megatron_lm.arguments():
        assert set(arg.flags) <= set(parser._option_string_actions), arg.flags


BASE = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --gpus 1".split()


def _check(argv: list[str]) -> tuple[str, ...]:
    return megatron_lm.check(flags.parse_flags(predict_parser(), [*BASE, *argv]))


def test_ignored_and_refused_flags():
    assert _check(
        ["--eval-interval", "100", "--tensorboard-dir", "/tmp/tb", "--log-throughput"]
    ) == ("--eval-interval", "--log-throughput", "--tensorboard-dir")
    with pytest.raises(CaptureError) as err:
        _check(["--moe-use-upcycling", "--fp4-format", "e2m1", "--eval-iters", "3"])
    text = str(err.value)
    assert "--moe-use-upcycling (this mixture-of-experts option is not modelled yet)" in text
    assert "--fp4-format e2m1 (this low-precision (fp8 / fp4) option is not modelled yet)" in text
    assert "--eval-iters" not in text


def test_defaults_given_explicitly_are_accepted():
    assert _check(["--moe-upcycling-granularity", "1", "--softmax-type", "vanilla"]) == (
        "--moe-upcycling-granularity",
        "--softmax-type",
    )
    with pytest.raises(CaptureError, match="--moe-use-upcycling"):
        _check(["--moe-use-upcycling"])
    assert _check(["--moe-router-topk-scaling-factor", "2.5"]) == (
        "--moe-router-topk-scaling-factor",
    )


def test_a_typo_gets_the_closest_megatron_flag():
    with pytest.raises(
        CaptureError, match=r"--atention-backend \(did you mean --attention-backend\?\)"
    ):
        flags.parse_flags(predict_parser(), ["--atention-backend", "flash"])


def test_flags_that_change_nothing_in_megatron_core_are_ignored():
    # megatron-core 0.16.1: --use-flash-attn is read by the legacy models only,
    # --enable-experimental swaps kernels only with --moe-permute-fusion (ruled on by its own
    # entry), decode-only CUDA graphs are inference only, nothing reads moe_extended_tp,
    # symmetric registration only chooses how NCCL registers the same buffers
    given = ["--use-flash-attn", "--enable-experimental"]
    # --moe-extended-tp: Megatron-LM core_v0.16.1's only (the installed series' table decides)
    given += ["--moe-extended-tp"] if "--moe-extended-tp" in megatron_lm.flag_names() else []
    given += ["--decode-only-cuda-graphs", "--disable-symmetric-registration"]
    names = [g for g in given if g.startswith("--")]
    assert _check(given) == tuple(sorted(names))
    for name in names:
        assert policy.ignored(name) and policy.IGNORED_REASONS[name]
    # Megatron-FSDP's knobs are modelled (features.fsdp) and, without --use-megatron-fsdp,
    # listed as ignored: megatron-core's DDP reads none of them
    knobs = ["--data-parallel-sharding-strategy", "optim_grads", "--fsdp-double-buffer"]
    knobs += ["--use-nccl-ub", "--use-flash-attn"]  # one Megatron-LM-only flag to run the check
    assert _check(knobs) == tuple(sorted(k for k in knobs if k.startswith("--")))
    assert _check([*knobs, "--use-megatron-fsdp"]) == ("--use-flash-attn",)


ROPE = ["--position-embedding-type", "rope"]


def test_no_position_embedding_is_ignored_with_rope_and_refused_as_megatron_does_without():
    assert _check([*ROPE, "--no-position-embedding"]) == ("--no-position-embedding",)
    with pytest.raises(CaptureError) as err:
        _check(["--no-position-embedding"])  # learned_absolute: Megatron-LM raises
    assert "Megatron-LM would not run this line: --no-position-embedding" in str(err.value)
    assert "--no-position-embedding is deprecated" in str(err.value)
    assert "\n" not in str(err.value)


def test_deprecated_rotary_switch_is_ignored_only_beside_rope():
    assert _check([*ROPE, "--use-rotary-position-embeddings"]) == (
        "--use-rotary-position-embeddings",
    )
    with pytest.raises(CaptureError, match="give --position-embedding-type rope"):
        _check(["--use-rotary-position-embeddings"])


def test_rope_type_is_read_as_megatron_lm_reads_it():
    """--rope-type is a field of the model's attention (config.attention), not a policy flag:
    rope without MLA is Megatron-LM's default and changes nothing; yarn needs MLA, as Megatron-LM
    asserts."""
    from capture_megatron.flags.args import model_shape

    def shape(argv: list[str]):
        return model_shape(flags.parse_flags(predict_parser(), [*BASE, *argv]), vocab_size=128)

    assert shape([*ROPE, "--rope-type", "rope"]).mla.rope == "rope"
    assert _check([*ROPE, "--rope-type", "rope"]) == ()  # read, so not listed as ignored
    with pytest.raises(CaptureError, match="needs --multi-latent-attention"):
        shape([*ROPE, "--rope-type", "yarn"])
    assert shape([*ROPE, "--multi-latent-attention"]).mla.rope == "yarn"  # MLA's default


@pytest.mark.parametrize("kind", ["none", "mrope", "relative"])
def test_megatron_lms_other_position_embeddings_are_refused_as_not_modelled(kind):
    from capture_megatron.flags.args import model_shape

    ns = flags.parse_flags(predict_parser(), [*BASE, "--position-embedding-type", kind])
    with pytest.raises(CaptureError, match=f"--position-embedding-type {kind} is not modelled"):
        model_shape(ns, 99)


TE = ["--transformer-impl", "transformer_engine"]
OFFLOAD = ["--fine-grained-activation-offloading"]


def test_offload_modules_alone_change_nothing_and_are_ignored():
    """megatron-core reads --offload-modules / --min-offloaded-tensor-size only under
    --fine-grained-activation-offloading (every call site tests that flag first)."""
    argv = ["--offload-modules", "core_attn", "--min-offloaded-tensor-size", "16"]
    assert _check(argv) == ("--min-offloaded-tensor-size", "--offload-modules")


def test_fine_grained_offloading_is_accepted_with_its_settings():
    """--fine-grained-activation-offloading is forecast (GPU kernel set): the line passes the
    Megatron-LM check and its settings reach the plan's DdpOptions."""
    argv = [*TE, *OFFLOAD, "--offload-modules", "core_attn", "attn_proj", "expert_fc1"]
    argv += ["--min-offloaded-tensor-size", "4096"]
    assert _check(argv) == ()
    ns = flags.parse_flags(predict_parser(), [*BASE, *argv])
    moved = flags.ddp_options(ns).activation_offload
    assert moved.groups == ("core_attn", "attn_proj", "expert_fc1")
    assert moved.min_offloaded_tensor_size == 4096


def test_fine_grained_offloading_is_refused_on_the_cpu_kernel_set():
    from capture_megatron.features.activation_offload import ActivationOffload

    on = ActivationOffload(True, ("core_attn",))
    assert "CPU kernel set" in activation_offload_problem(on, "cpu")
    assert "transformer_engine" in activation_offload_problem(on, "gpu:local/local")
    assert activation_offload_problem(on, "gpu:transformer_engine/auto") == ""
    assert activation_offload_problem(ActivationOffload(), "cpu") == ""


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--transformer-impl", "local", "--offload-modules", "core_attn"], "transformer_engine"),
        ([*TE], "at least one module"),
        ([*TE, "--offload-modules", "core_attn", "mlp"], "Invalid choices for offload_modules"),
        ([*TE, "--offload-modules", "attn_proj"], "attn_proj cannot be set"),
        (
            [*TE, "--offload-modules", "core_attn", "--cpu-offloading-num-layers", "1"],
            "cannot be enabled with cpu_offloading",
        ),
    ],
)
def test_fine_grained_offloading_megatron_refuses_is_named_in_one_paragraph(argv, named):
    with pytest.raises(CaptureError) as err:
        _check([*OFFLOAD, *argv])
    text = str(err.value)
    assert "Megatron-LM would not run this line: --fine-grained-activation-offloading" in text
    assert named in text and "\n" not in text
