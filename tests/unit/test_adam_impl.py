"""--adam-impl (issue 52): which Adam megatron-core trains with on a GPU. It imports Transformer
Engine's FusedAdam, else apex's, else torch.optim.AdamW (megatron-core 0.16.1
optimizer/__init__.py); torch's foreach step holds an fp32 temporary per updated element, which
the forecast adds for `torch`. auto is fused for a forecast and what is installed on a GPU; a
choice megatron-core's import order would not give is refused."""

from __future__ import annotations

import pytest

from capture_megatron.config import Kernels
from capture_megatron.config.kernels import kernel_set
from capture_megatron.errors import CaptureError
from capture_megatron.megatron.extensions import adam_impl, gpu_kernels
from capture_megatron.planner.emit import flag_notes


def _find(*installed: str):
    return lambda module: module in installed


@pytest.mark.parametrize(
    "installed, resolved",
    [((), "torch"), (("transformer_engine",), "fused"), (("apex.optimizers",), "fused")],
)
def test_auto_is_what_megatron_core_imports_on_this_machine(installed, resolved):
    assert adam_impl(Kernels(adam_impl="auto"), _find(*installed)) == resolved


def test_a_choice_megatron_core_would_not_make_is_refused():
    with pytest.raises(CaptureError, match="neither Transformer Engine nor apex is installed"):
        adam_impl(Kernels(adam_impl="fused"), _find())
    with pytest.raises(CaptureError, match="transformer_engine is installed"):
        adam_impl(Kernels(adam_impl="torch"), _find("transformer_engine"))


def test_the_kernel_set_names_torchs_adam_and_a_forecast_defaults_to_fused():
    local = Kernels(transformer_impl="local")
    assert kernel_set("fake-cuda", local) == "gpu:local/auto"
    assert kernel_set("fake-cuda", Kernels(transformer_impl="local", adam_impl="torch")).endswith(
        "/torch-adam"
    )
    gpu = gpu_kernels(Kernels(transformer_impl="local", masked_softmax_fusion=False,
                              gradient_accumulation_fusion=False, rope_fusion=False),
                      "local", _find())  # fmt: skip
    assert gpu.adam_impl == "torch" and kernel_set("cuda", gpu).endswith("/torch-adam")


def test_megatron_args_say_the_flag_is_capture_megatrons():
    from capture_megatron.config import ParallelPlan

    plan = ParallelPlan(tp=1, pp=1, dp=1, micro_batch_size=1, global_batch_size=1,
                        layers_per_stage=(2,))  # fmt: skip
    notes = flag_notes(plan, Kernels(adam_impl="torch"))
    assert any("--adam-impl torch is capture-megatron's" in n for n in notes)
    assert not any("--adam-impl" in n for n in flag_notes(plan, Kernels()))
