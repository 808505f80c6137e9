"""Fit: ProfileRecords -> MemoryModel. Pure Python + numpy (no torch).

    from capture_megatron.fit import fit, write_model
    model = fit(records)            # every variant present in the records
    write_model(model, "memory_model.json")

Per variant the model keeps exact constants at every probed shape (anchors) and, across shapes,
regressions on physically meaningful terms (terms, regression) or replayed allocation timelines
(timelines/). decompose turns records into constants, model holds the fitted objects, io reads and
writes them, quality reports residuals, leave-one-out and held-out errors.
"""

from capture_megatron.fit.decompose import fit, shape_sizes, sizes_of
from capture_megatron.fit.io import read_model, write_model
from capture_megatron.fit.model import (
    KindConstants,
    MemoryModel,
    ModelSource,
    Needs,
    RecordedSource,
    ShapeConstants,
    VariantModel,
)
from capture_megatron.fit.terms import Sizes

__all__ = [
    "KindConstants",
    "MemoryModel",
    "ModelSource",
    "Needs",
    "RecordedSource",
    "ShapeConstants",
    "Sizes",
    "VariantModel",
    "fit",
    "read_model",
    "shape_sizes",
    "sizes_of",
    "write_model",
]
