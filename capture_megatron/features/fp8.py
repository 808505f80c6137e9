"""FP8 training on the GPU kernel set: what Transformer Engine keeps for Megatron-LM's --fp8-*
flags, tensor by tensor, their choices and the kernel set's name for them (the flags are fields
of capture_megatron.config.kernels.Kernels, whose JSON names they keep; the other stages read
Kernels' generic properties: low_precision, low_precision_params, gemm_input_bytes). Its rules
are in capture_megatron.rules.modelled; its GPU kernel set emulation in
capture_megatron.emulate.gpu.fp8. Pure Python.

Sources: Transformer Engine 5671fd36 (the revision megatron-core 0.16.1 pins;
`transformer_engine/pytorch/`), on Hopper (sm90), whose FP8 GEMMs take only the TN layout
(`is_non_tn_fp8_gemm_supported()` is False below sm100): a tensor used column-wise (a weight in
dgrad, an input in wgrad) is kept as a transpose. docs/MEMORY_MODEL.md has the tables.

- Delayed (`Float8Quantizer`) and tensorwise (`Float8CurrentScalingQuantizer`): 1-byte data per
  usage (row-wise: the tensor; column-wise: its transpose) and one fp32 scale_inv
  (`tensor/float8_tensor.py` make_empty / quantize).
- MXFP8 (`MXFP8Quantizer`, `tensor/mxfp8_tensor.py:99-160`): 1-byte data per usage, 1-byte E8M0
  scales per 32 elements, row-wise `[round_up(rows, 128), round_up(cols / 32, 4)]`, column-wise
  `[round_up(rows / 32, 4), round_up(cols, 128)]`.
- Blockwise (`Float8BlockQuantizer`, `tensor/float8_blockwise_tensor.py:121-260`): 1-byte data per
  usage (column-wise transposed), fp32 scales; activations in 1 x 128 blocks, weights in
  128 x 128 blocks (`common/recipe/__init__.py:338-340`).
"""

from __future__ import annotations

FP8_FORMATS = ("", "e4m3", "hybrid")
"""--fp8-format choices ('': no FP8, Megatron-LM's default None)."""
FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise", "custom")
"""--fp8-recipe choices (Megatron-LM core_v0.16.1)."""
MODELLED_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")
"""Recipes whose tensors are modelled (custom takes a user's quantizer factory)."""
FLOAT8_RECIPES = ("delayed", "tensorwise")
"""Recipes with per-tensor scaling (Float8Tensor): their all-gather is row-wise only."""
BLOCK = 128
"""The blockwise recipe's block length."""
MX_BLOCK = 32
"""MXFP8's scaling block (MXFP8_BLOCK_SCALING_SIZE)."""


def key_parts(recipe: str, param_gather: bool, amax_history_len: int) -> list[str]:
    """The parts an FP8 run adds to its kernel set's name (config.kernels.Kernels.key): the
    recipe, FP8 parameters, a delayed recipe's amax history when not 1."""
    parts = [f"fp8-{recipe}"] + (["fp8-params"] if param_gather else [])
    if recipe == "delayed" and amax_history_len != 1:
        parts.append(f"amax{amax_history_len}")
    return parts


def _up(n: int, m: int) -> int:
    """n rounded up to a multiple of m."""
    return -(-n // m) * m


def _scales(recipe: str, rows: int, cols: int, columnwise: bool, weight: bool) -> int:
    """Bytes of the scale tensor of one usage of a [rows, cols] quantized tensor."""
    if recipe in FLOAT8_RECIPES:
        return 0  # one scale_inv per tensor, counted once by quantized_bytes
    if recipe == "mxfp8":
        if columnwise:
            return _up(rows // MX_BLOCK, 4) * _up(cols, 128)
        return _up(rows, 128) * _up(cols // MX_BLOCK, 4)
    if weight:  # 128 x 128 blocks
        r, c = -(-rows // BLOCK), -(-cols // BLOCK)
        return 4 * (c * _up(r, 4) if columnwise else r * _up(c, 4))
    if columnwise:  # 1 x 128 blocks along the rows
        return 4 * -(-rows // BLOCK) * _up(cols, 4)
    return 4 * -(-cols // BLOCK) * _up(rows, 4)


def quantized_bytes(
    recipe: str, rows: int, cols: int, rowwise: bool, columnwise: bool, weight: bool = False
) -> int:
    """Bytes of one Transformer Engine quantized tensor of logical shape [rows, cols] (rows: the
    product of the leading dimensions) holding the given usages, under `recipe` (weight: a weight
    tensor, whose blockwise scales are 128 x 128)."""
    if recipe not in MODELLED_RECIPES:
        raise ValueError(f"FP8 recipe {recipe!r} is not modelled")
    usages = [u for u, on in (("row", rowwise), ("col", columnwise)) if on]
    if not usages:
        return 0
    total = len(usages) * rows * cols
    total += sum(_scales(recipe, rows, cols, u == "col", weight) for u in usages)
    return total + (4 if recipe in FLOAT8_RECIPES else 0)


def saved_input_bytes(recipe: str, rows: int, cols: int, gathered: bool) -> int:
    """What a TE linear layer keeps of its [rows, cols] input for backward under FP8 (TE
    `module/linear.py:411-425`, `layernorm_linear.py` likewise): the column-wise copy the wgrad
    GEMM reads, except when the input is all-gathered in backward (a column-parallel layer with
    sequence parallelism) under per-tensor scaling, which all-gathers row-wise data only: then the
    local row-wise shard."""
    rowwise = gathered and recipe in FLOAT8_RECIPES
    return quantized_bytes(recipe, rows, cols, rowwise, not rowwise)


def weight_cache_bytes(recipe: str, out_features: int, in_features: int, param_gather: bool) -> int:
    """Bytes a TE linear layer keeps for its [out, in] weight between iterations beyond the
    parameter itself. Without --fp8-param-gather: the FP8 workspace cached under 'weight'
    (`module/base.py:1346-1456` get_weight_workspace; Megatron passes is_first_microbatch, so the
    workspace is cached for the module's life), row-wise for fprop and column-wise for dgrad. With
    it the parameter is the FP8 tensor (its row-wise data in DDP's param buffer); TE adds the
    column-wise data (`update_usage(columnwise_usage=True)`, 1386-1393) and the scales."""
    both = quantized_bytes(recipe, out_features, in_features, True, True, weight=True)
    return both - out_features * in_features if param_gather else both


def scaling_state_bytes(recipe: str, gemms: int, amax_history_len: int) -> int:
    """Bytes of a TE module's scaling state for `gemms` GEMMs (3 forward quantizers per GEMM --
    input, weight, output -- and 2 backward: `module/base.py:730-742`). Delayed scaling
    (DelayedScalingRecipeState, `quantization.py:1049-1090`): per direction an fp32 scale [n] and
    amax history [len, n]; tensorwise (Float8CurrentScalingQuantizer): an fp32 scale [1] and amax
    [1] per quantizer; MXFP8 and blockwise keep none."""
    n = 5 * gemms
    if recipe == "delayed":
        return 4 * (n + n * amax_history_len)
    if recipe == "tensorwise":
        return 8 * n
    return 0
