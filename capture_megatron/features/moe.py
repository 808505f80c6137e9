"""Experts: a model's mixture-of-experts layers in Megatron's terms, each field with its flag.

Megatron-LM's defaults (core_v0.16.1) are the fields' defaults; `num_experts` 0 means a dense
model. `moe_layer_freq` is kept as Megatron spells it (an integer N: every N-th layer from the
first is an MoE layer; or a Python list expression such as "([0]*3+[1]*58)") and evaluated here
without eval(). Pure Python: no torch import here.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from dataclasses import dataclass

from capture_megatron.errors import CaptureError
from capture_megatron.fields import flag
from capture_megatron.serial import OMIT_DEFAULT, JsonMixin

DISPATCHERS = ("allgather", "alltoall", "flex")
"""Megatron's --moe-token-dispatcher-type choices."""
BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
"""Megatron's --moe-router-load-balancing-type choices."""
SCORE_FUNCTIONS = ("softmax", "sigmoid")
"""Megatron's --moe-router-score-function choices."""
FLEX_BACKENDS = ("deepep", "hybridep")
"""Megatron's --moe-flex-dispatcher-backend choices (deepep is its default); what megatron-core
0.16.1 and capture-megatron make of them: capture_megatron.features.dispatch."""


@dataclass(frozen=True)
class Experts(JsonMixin):
    """Mixture-of-experts layers (Megatron's MoE flags); num_experts 0 means a dense model."""

    num_experts: int = flag("--num-experts", 0)
    """Routed experts per MoE layer (0: no MoE layers)."""
    moe_router_topk: int = flag("--moe-router-topk", 2)
    """Experts each token is routed to."""
    moe_ffn_hidden_size: int = flag("--moe-ffn-hidden-size", 0)
    """Each routed expert's MLP width; 0 means --ffn-hidden-size."""
    moe_shared_expert_intermediate_size: int = flag("--moe-shared-expert-intermediate-size", 0)
    """Width of the shared experts' MLP, all shared experts together (0: none)."""
    moe_shared_expert_gate: bool = flag("--moe-shared-expert-gate", False)
    """A sigmoid gate on the shared experts' output (Qwen2-MoE's)."""
    moe_layer_freq: str = flag("--moe-layer-freq", "1", note='(N, or e.g. "([0]*3+[1]*58)")')
    """Which layers are MoE layers: every N-th from the first, or a 0/1 pattern per layer."""
    moe_token_dispatcher_type: str = flag(
        "--moe-token-dispatcher-type", "allgather", choices=DISPATCHERS
    )
    """How tokens reach the experts' ranks."""
    moe_flex_dispatcher_backend: str = flag(
        "--moe-flex-dispatcher-backend", "deepep", choices=FLEX_BACKENDS, omit_default=True
    )
    """The flex dispatcher's communication library: deepep or hybridep (both forecast on the GPU
    kernel set, their buffers counted outside the allocator); read only with
    --moe-token-dispatcher-type flex (capture_megatron.features.dispatch)."""
    moe_deepep_num_sms: int = flag("--moe-deepep-num-sms", 20, omit_default=True)
    """SMs of DeepEP's dispatch and combine kernels: two per channel, and DeepEP's buffers grow
    with the channels (features.dispatch.deepep_buffer_bytes); read only with the flex
    dispatcher's deepep backend."""
    moe_expert_capacity_factor: float = flag(
        "--moe-expert-capacity-factor", 0.0, note="(0 or absent: dropless)"
    )
    """Tokens an expert takes, as a factor of the balanced share; 0 means dropless routing."""
    moe_pad_expert_input_to_capacity: bool = flag("--moe-pad-expert-input-to-capacity", False)
    """Pad every expert's input to its capacity (static shapes)."""
    moe_grouped_gemm: bool = flag("--moe-grouped-gemm", False)
    """One grouped GEMM over a rank's local experts (TE's GroupedMLP)."""
    moe_router_load_balancing_type: str = flag(
        "--moe-router-load-balancing-type", "aux_loss", choices=BALANCING
    )
    """The router's load-balancing strategy."""
    moe_aux_loss_coeff: float = flag("--moe-aux-loss-coeff", 0.0)
    """Scaling of the load-balancing loss."""
    moe_router_score_function: str = flag(
        "--moe-router-score-function", "softmax", choices=SCORE_FUNCTIONS
    )
    """Softmax or sigmoid routing scores."""
    moe_router_pre_softmax: bool = flag("--moe-router-pre-softmax", False)
    """Softmax before the top-k selection."""
    moe_router_num_groups: int = flag("--moe-router-num-groups", 0, omit_default=True)
    """Groups the experts are split into for group-limited routing (DeepSeek-V3's n_group: one
    group per node in its training; 0: none). No memory: megatron-core masks the scores of the
    groups not chosen in place; the step-time model's flex dispatch reads it (steptime.moe)."""
    moe_router_group_topk: int = flag("--moe-router-group-topk", 0, omit_default=True)
    """The groups a token's top-k experts may come from (DeepSeek-V3's topk_group; read with
    --moe-router-num-groups)."""
    moe_router_dtype: str = flag("--moe-router-dtype", "", choices=("", "fp32", "fp64"))
    """Precision of the routing computation (empty: the model's)."""
    moe_router_force_load_balancing: bool = flag("--moe-router-force-load-balancing", False)
    """Route by random logits (megatron-core's load-balanced benchmark mode): balanced routing."""
    moe_imbalance_factor: float = flag(
        "--moe-imbalance-factor",
        0.0,
        note="(capture-megatron; 0: the forecast from measured routing statistics)",
    )
    """Dropless routing only: the most tokens any expert receives, as a factor of its balanced
    share, that the forecast assumes. 0 means the default: the imbalance expected of the run, from
    routing statistics measured in aux-loss-balanced training (capture_megatron.forecast.routing);
    experts / top-k is the worst case."""
    routing_case: str = "forecast"
    """Set by predict and plan, never by a flag: which dropless routing factor a prediction
    assumes (forecast, planning: the forecast plus its margin, or bound: the worst case)."""
    router_lr_sum: float | None = dataclasses.field(default=None, metadata={OMIT_DEFAULT: True})
    """Set by predict from a Megatron-LM command line that gives --train-iters, never by a flag:
    the learning rate summed over the run's iterations (capture_megatron.forecast.routing
    .lr_sum), which tells whether its routers still route as initialised; None: a run long
    enough that they train (the trained routing statistics)."""
    routing_bound: bool = False
    """Set by the profiler, never by a flag: the capacity and padding are a forecast's bound on
    routing (capture_megatron.forecast.support.experts_probe), not the user's settings; a probe
    pads sinkhorn routing too, which megatron-core's router allows after any load balancing."""

    def __post_init__(self) -> None:
        p: list[str] = []
        if self.num_experts < 0:
            p.append(f"--num-experts {self.num_experts} must be >= 0")
        if self.num_experts and not 1 <= self.moe_router_topk <= self.num_experts:
            p.append(
                f"--moe-router-topk {self.moe_router_topk} must be between 1 and --num-experts "
                f"{self.num_experts}"
            )
        for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
            if getattr(self, name) < 0:
                p.append(f"--{name.replace('_', '-')} {getattr(self, name)} must be >= 0")
        if self.moe_expert_capacity_factor < 0 or self.moe_imbalance_factor < 0:
            p.append(
                f"--moe-expert-capacity-factor {self.moe_expert_capacity_factor} and "
                f"--moe-imbalance-factor {self.moe_imbalance_factor} must be >= 0"
            )
        if self.moe_pad_expert_input_to_capacity and not self.moe_expert_capacity_factor:
            p.append("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
        sinkhorn = self.moe_router_load_balancing_type == "sinkhorn"
        if self.moe_expert_capacity_factor and sinkhorn and not self.routing_bound:
            p.append(
                "--moe-expert-capacity-factor works only with aux_loss, seq_aux_loss, "
                "global_aux_loss or none load balancing (Megatron refuses sinkhorn)"
            )
        if self.routing_case not in ("forecast", "planning", "bound"):
            p.append(f"routing case {self.routing_case!r} is not forecast, planning or bound")
        p += self._router_problems()
        if p:
            raise CaptureError("mixture of experts: " + "; ".join(p))

    def _router_problems(self) -> list[str]:
        """Router settings megatron-core refuses while building or running the model."""
        p = self._group_problems()
        if self.moe_router_load_balancing_type == "sinkhorn" and self.moe_aux_loss_coeff:
            p.append(
                f"--moe-aux-loss-coeff {self.moe_aux_loss_coeff} with "
                "--moe-router-load-balancing-type sinkhorn (megatron-core's router asserts that "
                "sinkhorn routing has no aux loss; leave the coefficient at 0)"
            )
        if (
            self.num_experts
            and self.moe_router_topk == 1
            and self.moe_router_score_function == "softmax"
            and not self.moe_router_pre_softmax
            and self.moe_router_load_balancing_type != "sinkhorn"
        ):
            p.append(
                "--moe-router-topk 1 with softmax scores needs --moe-router-pre-softmax "
                "(megatron-core refuses it: a softmax over one selected expert has zero gradient)"
            )
        return p

    def _group_problems(self) -> list[str]:
        """Group-limited routing megatron-core 0.16.1 refuses (router's group_limited_topk:
        experts split evenly into the groups, top-k within the chosen groups)."""
        groups, limit = self.moe_router_num_groups, self.moe_router_group_topk
        if not self.num_experts or (not groups and not limit):
            return []
        name = f"--moe-router-num-groups {groups} --moe-router-group-topk {limit}"
        if groups < 1 or not 1 <= limit <= groups:
            return [f"{name}: give both, with 1 <= the group top-k <= the groups"]
        if self.num_experts % groups or self.moe_router_topk > limit * self.num_experts // groups:
            return [
                f"{name}: the {self.num_experts} experts must split evenly into the groups, and "
                f"the chosen groups hold at least --moe-router-topk {self.moe_router_topk} of them"
            ]
        return []

    @property
    def enabled(self) -> bool:
        """Whether the model has MoE layers."""
        return self.num_experts > 0

    @property
    def dropless(self) -> bool:
        """Whether routing drops no token (no capacity factor): tokens per expert vary."""
        return self.enabled and not self.moe_expert_capacity_factor

    def ffn(self, dense_ffn: int) -> int:
        """A routed expert's MLP width with Megatron's default (the dense width) applied."""
        return self.moe_ffn_hidden_size or dense_ffn

    def pattern(self, num_layers: int) -> tuple[bool, ...]:
        """Per layer, whether it is an MoE layer (all False for a dense model)."""
        if not self.enabled:
            return (False,) * num_layers
        return moe_layer_pattern(self.moe_layer_freq, num_layers)


_LIST_EXPR = re.compile(r"^[\[\]\(\)\d\s,*+]+$")


def moe_layer_pattern(freq: str, num_layers: int) -> tuple[bool, ...]:
    """Megatron's --moe-layer-freq for `num_layers` layers: N (layer i is MoE when i % N == 0) or
    a list expression of 0/1 with exactly one entry per layer; CaptureError otherwise."""
    text = freq.strip()
    if text.isdigit():
        n = int(text)
        if n < 1:
            raise CaptureError(f"--moe-layer-freq {freq!r} must be at least 1")
        return tuple(i % n == 0 for i in range(num_layers))
    values = _list_value(text) if _LIST_EXPR.match(text) else None
    if values is None or any(v not in (0, 1) for v in values):
        raise CaptureError(
            f"--moe-layer-freq {freq!r} is neither an integer nor a list expression of 0 and 1 "
            'such as "([0]*3+[1]*58)"'
        )
    if len(values) != num_layers:
        raise CaptureError(
            f"--moe-layer-freq {freq!r} gives {len(values)} layers but --num-layers is {num_layers}"
        )
    return tuple(bool(v) for v in values)


def _list_value(text: str) -> list[int] | None:
    """The value of a list expression of integer lists, '+' and '* int' (no eval: the parsed
    expression is walked, and anything else is refused)."""
    try:
        value = _walk(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        return None
    return value if isinstance(value, list) else None


def _walk(node: ast.AST) -> list[int] | int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        items = [_walk(e) for e in node.elts]
        if any(not isinstance(i, int) for i in items):
            raise ValueError("nested list")
        return [int(i) for i in items]  # type: ignore[arg-type]  # all ints: checked above
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _walk(node.left), _walk(node.right)
        if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
            return left + right
        if isinstance(node.op, ast.Mult) and isinstance(left, list) and isinstance(right, int):
            return left * right
    raise ValueError("not a list expression")
