"""Optimizer state across a change of megatron-core's optimizer chain (EP 1 <-> EP > 1).

megatron-core 0.16.1's get_megatron_optimizer builds one optimizer when every parameter is
all-reduced over data parallelism, and a ChainedOptimizer of two (dense parameters, then expert
parameters) when some are not: expert weights are marked ``allreduce=False`` only when EP > 1
(``tensor_parallel/layers.py``: ``not (is_expert and expert_parallel)``). The optimizer's tensors
are keyed by model parameter in a checkpoint and reshard freely, but its common part -- the param
groups' hyperparameters, Adam's step, the grad scaler -- is saved in the structure of the saving
run's chain (``{0: dense, 1: experts}`` or one dict), and ``dist_checkpointing.load`` merges it
into the loading run's structure as it is: EP 2 -> EP 1 fails (KeyError 'pre_wd_mult', or
'optimizer' with the distributed optimizer), EP 1 -> EP 2 too ("Expected 2 entries in state dict,
but got 4"). Stock Megatron-LM loads the same way and fails the same way.

``RechainedCommon`` is the checkpoint's own common load strategy with one change: when the saved
chain length differs from the loading optimizer's, the saved common optimizer state is rewritten
into the loading run's structure before the merge. Every part takes the loading optimizer's own
common values (its param groups as this run's flags build them; learning rate and weight decay are
then set by the scheduler from its checkpointed state) with the saved Adam step and grad-scaler
state (ChainedOptimizer keeps the step equal in every part). A checkpoint loaded under the same
chain is read unchanged.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy


def chain_length(optim_common: Any) -> int:
    """Optimizers in the chain a common optimizer state was built by (int keys: one each)."""
    if isinstance(optim_common, dict):
        keys = [k for k in optim_common if isinstance(k, int)]
        return len(keys) or 1
    return 1


def parts(optim_common: dict) -> list:
    """The per-optimizer parts of a common optimizer state, in chain order."""
    n = chain_length(optim_common)
    return [optim_common[i] for i in range(n)] if n > 1 else [optim_common]


def plain_values(sharded_optim: dict[str, Any]) -> dict[str, Any]:
    """The common (non-sharded) values of a sharded optimizer state dict, copied."""
    from megatron.core.dist_checkpointing.dict_utils import extract_matching_values
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase

    _, plain = extract_matching_values(
        sharded_optim, lambda v: isinstance(v, (ShardedBase, LocalNonpersistentObject))
    )
    assert isinstance(plain, dict), "a dict in, a dict out"
    return copy.deepcopy(plain)


def _walk(tree: Any) -> Iterator[dict[str, Any]]:
    """Every dict in a nested dict/list tree."""
    if isinstance(tree, dict):
        yield tree
        for v in tree.values():
            yield from _walk(v)
    elif isinstance(tree, list):
        for v in tree:
            yield from _walk(v)


def saved_step(tree: Any) -> Any:
    """Adam's step in a common optimizer part: ``state['common_step']`` (FP32 / mixed-precision
    optimizers) or the param groups' 'step' (distributed optimizer); None when absent."""
    for d in _walk(tree):
        if "common_step" in d:
            return d["common_step"]
        for group in d.get("param_groups", []) if isinstance(d.get("param_groups"), list) else []:
            if isinstance(group, dict) and "step" in group:
                return group["step"]
    return None


def _set_step(tree: Any, step: Any) -> None:
    """Put `step` wherever the part keeps it (see saved_step)."""
    for d in _walk(tree):
        if "common_step" in d:
            d["common_step"] = step
        groups = d.get("param_groups")
        for group in groups if isinstance(groups, list) else []:
            if isinstance(group, dict) and "step" in group:
                group["step"] = step


def rechain(saved: dict, template: dict) -> dict:
    """The saved common optimizer state `saved` in the chain of `template` (the loading
    optimizer's plain_values): the template with the saved step and grad scaler."""
    if chain_length(saved) == chain_length(template):
        return saved
    step = saved_step(saved)
    scaler = next((p["grad_scaler"] for p in parts(saved) if "grad_scaler" in p), None)
    out = copy.deepcopy(template)
    for part in parts(out):
        if step is not None and saved_step(part) is None:
            # the loading optimizer has no step yet: FP32 / mixed-precision optimizers keep it
            # as state['common_step'] next to their param groups
            holder = next(d for d in _walk(part) if isinstance(d.get("param_groups"), list))
            holder.setdefault("state", {})["common_step"] = step
        elif step is not None:
            _set_step(part, step)
        if scaler is not None and "grad_scaler" in part:
            part["grad_scaler"] = copy.deepcopy(scaler)
    return out


def rechained_common(template: dict[str, Any]) -> TorchCommonLoadStrategy:
    """A LoadCommonStrategy for dist_checkpointing.load that rewrites the checkpoint's common
    'optimizer' state into the chain of `template` (see the module docstring)."""
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class RechainedCommon(TorchCommonLoadStrategy):
        """torch_dist's common load strategy, with the optimizer state rechained."""

        def load_common(self, checkpoint_dir: str | Path) -> dict[str, Any]:
            """The common state dict, its 'optimizer' in the loading optimizer's chain."""
            common = super().load_common(checkpoint_dir)
            if "optimizer" in common:
                common["optimizer"] = rechain(common["optimizer"], template)
            return common

    return RechainedCommon()
