"""Megatron-LM's pretrain_gpt.py with capture-megatron's per-stage recompute, without patching
Megatron-Core. Supported: Megatron-LM core_v0.16.x checkouts (pretrain_gpt.py importing
`model_provider` and `gpt_builders.gpt_builder`, `pretrain(..., extra_args_provider=...)`).

    export MEGATRON_LM=/path/to/Megatron-LM
    torchrun ... patches/capture_pretrain_gpt.py <your pretrain_gpt.py flags> \\
        --pipeline-model-parallel-layout 'Ett|ttt|ttt|ttL' \\
        --recompute-granularity full --recompute-method block --recompute-num-layers 3 \\
        --recompute-num-layers-per-stage 3,2,1,0

It adds one flag, --recompute-num-layers-per-stage (one count per pipeline stage), and wraps the
model builder so that each pipeline rank builds its chunks with its own recompute_num_layers (0:
no recompute on that stage). Everything else is the user's pretrain_gpt.py, run unchanged.
`capture-megatron megatron-lm` writes this command for a plan. Not runnable without a Megatron-LM
checkout (megatron.training is not part of the megatron-core wheel); see patches/README.md. Where
torch sees no CUDA device, Megatron-LM runs on CPU with the shims of
capture_megatron.megatron_lm.cpu (a check of the wrapper; Megatron-LM itself needs CUDA).
"""

from __future__ import annotations

import copy
import os
import runpy
import sys

PARENT = os.getppid()
"""The process that started this one (torchrun's agent), read at import."""


def stage_recompute(args, pp_rank: int):
    """A copy of Megatron-LM's args with this pipeline rank's recompute count (None: unchanged)."""
    counts = getattr(args, "recompute_num_layers_per_stage", None)
    if not counts:
        return args
    if len(counts) != args.pipeline_model_parallel_size:
        raise SystemExit(
            f"--recompute-num-layers-per-stage has {len(counts)} counts for "
            f"{args.pipeline_model_parallel_size} pipeline stages"
        )
    staged = copy.copy(args)
    if counts[pp_rank] == 0:
        staged.recompute_granularity = staged.recompute_method = staged.recompute_num_layers = None
    else:
        staged.recompute_granularity, staged.recompute_method = "full", "block"
        staged.recompute_num_layers = counts[pp_rank]
    return staged


def _first_of_stage(parallel_state) -> bool:
    """Whether this process is the first (TP 0, DP 0, CP 0) of its pipeline stage."""
    return (
        parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank() == 0
        and parallel_state.get_context_parallel_rank() == 0
    )


def add_capture_args(parser, inner=None):
    """extra_args_provider: the per-stage flag (and the script's own extra args, if any)."""
    parser = inner(parser) if inner else parser
    group = parser.add_argument_group("capture-megatron")
    group.add_argument(
        "--recompute-num-layers-per-stage",
        type=lambda s: [int(x) for x in s.split(",")],
        default=None,
        help="full-recompute layers per pipeline stage, comma separated",
    )
    return parser


def _load(checkout: str) -> dict:
    """pretrain_gpt.py's globals (its main block not run), after the CPU shims where needed."""
    sys.path.insert(0, checkout)
    try:
        cpu = _cpu_shims()
        module = runpy.run_path(
            os.path.join(checkout, "pretrain_gpt.py"), run_name="capture_pretrain_gpt"
        )
    except ModuleNotFoundError as err:
        print(
            f"capture-megatron: error: Megatron-LM's pretrain_gpt.py in {checkout} imports "
            f"{err.name!r}, which is not installed here; `capture-megatron megatron-lm` names "
            "every missing module and the pip command before it launches.",
            file=sys.stderr,
        )
        raise SystemExit(2) from None
    module["capture_cpu"] = cpu
    return module


def _cpu_shims() -> bool:
    """Apply the CPU shims and flags when there is no CUDA device; whether they were applied."""
    from capture_megatron.emulate import cpu_compat
    from capture_megatron.megatron_lm import cpu as lm_cpu

    if not cpu_compat.needed():
        return False
    lm_cpu.apply()
    sys.argv += list(lm_cpu.CPU_FLAGS)
    if os.environ.get("RANK", "0") == "0":
        print(
            "capture-megatron: no CUDA device: running Megatron-LM on CPU (gloo) with "
            "capture-megatron's CPU shims and " + " ".join(lm_cpu.CPU_FLAGS),
            flush=True,
        )
    return True


def main() -> None:
    """Run $MEGATRON_LM's pretrain_gpt.py with the per-stage recompute builder and flag."""
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun rank: never outlive torchrun
        from capture_megatron.megatron.lifeline import die_with_parent, forks_die_with_this

        die_with_parent(PARENT)
        forks_die_with_this()  # nor its forked checkpoint writers
    checkout = os.environ.get("MEGATRON_LM")
    if not checkout or not os.path.isfile(os.path.join(checkout, "pretrain_gpt.py")):
        raise SystemExit(
            "set MEGATRON_LM to a Megatron-LM checkout (core_v0.16.x) holding pretrain_gpt.py"
        )
    module = _load(checkout)
    from functools import partial

    from megatron.core import parallel_state
    from megatron.core.enums import ModelType

    builder = module["gpt_builder"]

    def staged_builder(
        args, pre_process, post_process, vp_stage=None, config=None, pg_collection=None
    ):
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        staged = stage_recompute(args, pp_rank)
        model = builder(
            staged,
            pre_process,
            post_process,
            vp_stage,
            config=config,
            pg_collection=pg_collection,
        )
        if staged is not args and not vp_stage and _first_of_stage(parallel_state):
            built = model.config  # what Megatron built the chunk with
            count = built.recompute_num_layers if built.recompute_granularity == "full" else 0
            print(
                f"capture-megatron: pipeline rank {pp_rank} recomputes {count} layer(s) per "
                "model chunk",
                flush=True,
            )
        if module["capture_cpu"]:
            from capture_megatron.megatron_lm.cpu import gloo_p2p

            model = gloo_p2p(model)
        return model

    inner = module.get("add_modelopt_args") if module.get("has_nvidia_modelopt") else None
    module["train_valid_test_datasets_provider"].is_distributed = True
    module["pretrain"](
        module["train_valid_test_datasets_provider"],
        partial(module["model_provider"], staged_builder),
        ModelType.encoder_or_decoder,
        module["forward_step"],
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
        extra_args_provider=partial(add_capture_args, inner=inner),
        get_embedding_ranks=module.get("get_embedding_ranks"),
    )


if __name__ == "__main__":
    main()
