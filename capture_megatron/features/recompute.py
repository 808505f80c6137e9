"""Activation recomputation: Recompute (granularity, full recompute's method and per-stage counts,
selective recompute's modules) and what megatron-core 0.16.1 requires of the modules for a model.

Megatron-LM core_v0.16.1: `--recompute-granularity selective` checkpoints the submodules named by
`--recompute-modules` (megatron-core's TransformerConfig.recompute_modules, default
["core_attn"]; its __post_init__ checks them). Pure Python: no torch import here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from capture_megatron.errors import CaptureError, require
from capture_megatron.serial import JsonMixin

if TYPE_CHECKING:
    pass

RECOMPUTE_GRANULARITIES = ("none", "selective", "full")
"""Activation recomputation granularities (none: keep every activation)."""
RECOMPUTE_METHODS = ("block", "uniform")
"""Megatron's --recompute-method choices."""
RECOMPUTE_MODULES = (
    "core_attn",
    "layernorm",
    "mla_up_proj",
    "mlp",
    "moe",
    "moe_act",
    "shared_experts",
)
"""megatron-core 0.16.1's recompute_modules choices (TransformerConfig.__post_init__)."""
DEFAULT_MODULES = ("core_attn",)
"""What selective recompute checkpoints when --recompute-modules is not given (megatron-core's
default)."""


def module_set(modules: tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    """A --recompute-modules list as one canonical tuple: sorted, each once (megatron-core tests
    membership only, so order and repeats change nothing); None: the default."""
    return tuple(sorted(set(modules))) if modules is not None else DEFAULT_MODULES


@dataclass(frozen=True)
class Recompute(JsonMixin):
    """Activation recomputation, possibly different on every pipeline stage."""

    granularity: str = "none"
    """none, selective (the `modules` of every layer) or full (whole layers)."""
    method: str = "block"
    """For full: block (the first n layers of each model chunk) or uniform (all layers, n at a
    time)."""
    num_layers: tuple[int, ...] = ()
    """For full: n per pipeline stage (one entry per pp rank, applied to each of its chunks)."""
    modules: tuple[str, ...] = ()
    """--recompute-modules as given (empty: not given, megatron-core's default core_attn). Only
    selective recompute reads them (megatron-core ignores them otherwise; they are kept so that a
    plan hands back what the user gave)."""

    def __post_init__(self) -> None:
        p: list[str] = []
        if self.granularity not in RECOMPUTE_GRANULARITIES:
            p.append(f"granularity {self.granularity!r} not one of {RECOMPUTE_GRANULARITIES}")
        if self.method not in RECOMPUTE_METHODS:
            p.append(f"method {self.method!r} not one of {RECOMPUTE_METHODS}")
        if self.granularity == "full" and not self.num_layers:
            p.append("full recompute needs num_layers per stage")
        if self.granularity != "full" and self.num_layers:
            p.append(f"num_layers {list(self.num_layers)} only applies to full recompute")
        if any(n < 0 for n in self.num_layers):
            p.append(f"negative recompute layers {list(self.num_layers)}")
        if self.method == "uniform" and len(set(self.num_layers)) > 1:
            p.append("per-stage recompute counts need method 'block'")
        unknown = [m for m in self.modules if m not in RECOMPUTE_MODULES]
        if unknown:
            p.append(
                f"--recompute-modules {' '.join(unknown)}: megatron-core 0.16.1 allows only "
                f"{', '.join(RECOMPUTE_MODULES)}"
            )
        require(p, "recompute setting")

    @classmethod
    def selective(cls, modules: tuple[str, ...] | list[str] | None = None) -> Recompute:
        """Selective recompute of `modules` as given (None: megatron-core's default, core_attn)."""
        return cls("selective", modules=tuple(modules or ()))

    @property
    def module_key(self) -> tuple[str, ...]:
        """The recomputed modules as a fitted variant keys them: sorted, each once, empty for
        the default (core_attn) and when not selective."""
        chosen = module_set(self.selected) if self.selected else ()
        return () if chosen == DEFAULT_MODULES else chosen

    @property
    def selected(self) -> tuple[str, ...]:
        """The submodules selective recompute checkpoints (empty when not selective)."""
        if self.granularity != "selective":
            return ()
        return tuple(self.modules) or DEFAULT_MODULES

    def layers_on(self, pp_rank: int) -> int:
        """Full-recompute n of a pipeline stage (0 when not full)."""
        return self.num_layers[pp_rank] if self.granularity == "full" else 0


def variant_modules(granularity: str, modules: tuple[str, ...]) -> tuple[str, ...]:
    """The modules a fitted variant of recompute `granularity` keys (Recompute.module_key) for
    --recompute-modules `modules` as given."""
    return Recompute.selective(modules).module_key if granularity == "selective" else ()


def check_variant_modules(granularity: str, modules: tuple[str, ...]) -> None:
    """CaptureError unless `modules` are a fitted variant's: empty, or for selective recompute
    sorted, each once, known to megatron-core and not the default core_attn alone."""
    canonical = Recompute.selective(modules).module_key  # checks the names too
    if modules and (granularity != "selective" or modules != canonical):
        raise CaptureError(
            f"variant: recompute modules {list(modules)} are kept only for selective recompute, "
            "sorted, each once, and not the default core_attn alone"
        )
