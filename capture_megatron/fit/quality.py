"""How good a fit is: each fitted quantity's sample count, largest residual and leave-one-out
error, for the `capture-megatron fit` table."""

from __future__ import annotations

from capture_megatron.fit.model import MemoryModel


def quality_rows(model: MemoryModel) -> list[tuple[str, str, int, float, float]]:
    """(variant, quantity, samples, max |residual| bytes, leave-one-out max relative error)."""
    rows = []
    for vm in model.variants:
        v = vm.variant
        name = f"{v.dtype}/{v.recompute}/{'sp' if v.sequence_parallel else 'nosp'}"
        rows.append(
            (
                name,
                "layer saved S",
                vm.layer_saved.samples,
                vm.layer_saved.max_abs_residual,
                vm.layer_saved.loo_max_rel_error,
            )
        )
        for chunk in vm.chunks:
            for field, reg in chunk.fields:
                rows.append(
                    (
                        name,
                        f"{chunk.kind}.{field}",
                        reg.samples,
                        reg.max_abs_residual,
                        reg.loo_max_rel_error,
                    )
                )
        for w in vm.windows:
            probe = f"{w.kind}({w.layers},{w.recompute_layers}).{w.window}"
            rows.append(
                (
                    name,
                    f"{probe} peak (timeline)",
                    w.model.samples,
                    w.model.max_abs_residual,
                    w.model.loo_max_rel_error,
                )
            )
            if w.window == "forward":
                rows.append(
                    (
                        name,
                        f"{probe} saved (timeline)",
                        w.model.samples,
                        w.model.max_abs_residual,
                        w.model.kept_loo_max_rel_error,
                    )
                )
    return rows
