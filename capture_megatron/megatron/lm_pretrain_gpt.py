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
checkout (megatron.training is not part of the megatron-core wheel); see patches/README.md.
"""

from __future__ import annotations

import copy
import os
import runpy
import sys


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


def main() -> None:
    """Run $MEGATRON_LM's pretrain_gpt.py with the per-stage recompute builder and flag."""
    checkout = os.environ.get("MEGATRON_LM")
    if not checkout or not os.path.isfile(os.path.join(checkout, "pretrain_gpt.py")):
        raise SystemExit(
            "set MEGATRON_LM to a Megatron-LM checkout (core_v0.16.x) holding pretrain_gpt.py"
        )
    sys.path.insert(0, checkout)
    module = runpy.run_path(
        os.path.join(checkout, "pretrain_gpt.py"), run_name="capture_pretrain_gpt"
    )
    from functools import partial

    from megatron.core import parallel_state
    from megatron.core.enums import ModelType

    builder = module["gpt_builder"]

    def staged_builder(
        args, pre_process, post_process, vp_stage=None, config=None, pg_collection=None
    ):
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        return builder(
            stage_recompute(args, pp_rank),
            pre_process,
            post_process,
            vp_stage,
            config=config,
            pg_collection=pg_collection,
        )

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
