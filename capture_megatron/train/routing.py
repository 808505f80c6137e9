"""Routing statistics of a training run (`pretrain_gpt --moe-routing-stats PATH`).

Megatron-core's routers are watched with forward hooks, nothing of theirs is replaced: each
TopKRouter's routing map (tokens x experts, True where a token goes) is counted per sequence of
the micro-batch, and each MoE layer's experts module reports, through a forward pre-hook, the
tokens per local expert that the token dispatcher delivered to this rank (what sizes its expert
buffers). Every optimizer step closes a record. Rank 0 gathers every rank's records and writes
them as JSON (gzip when PATH ends in .gz): per rank its coordinates, its MoE layers, and per step
and layer the per-sequence counts [sequence][expert] and the received counts
[micro-batch][local expert].

The per-sequence counts do not depend on how the run is split: summing them over the sequences a
group of expert-parallel ranks holds gives the tokens each of those ranks receives (checked
against the received counts by tests/dist/test_moe_routing.py), so one run's counts give the
routing imbalance of any expert-parallel size and micro-batch size (bench/moe_routing.py).

Full recompute runs a router twice per micro-batch and is refused with this option; with TP > 1
and without sequence parallelism the TP ranks of a group see the same tokens (each records them).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

Hook = Callable[..., None]
"""A forward hook or forward pre-hook of torch.nn.Module."""


def _moe_layers(chunks: Sequence[torch.nn.Module]) -> list[tuple[int, Any, Any]]:
    """(layer number, router, experts) of every MoE layer in this rank's chunks (megatron-core
    declares MoELayer.experts None until its constructor builds it, its routers as a
    RouterInterface: Any here)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_layer import TransformerLayer

    found: list[tuple[int, Any, Any]] = []
    for chunk in chunks:
        for layer in chunk.modules():
            if isinstance(layer, TransformerLayer) and isinstance(layer.mlp, MoELayer):
                found.append((layer.layer_number, layer.mlp.router, layer.mlp.experts))
    return sorted(found, key=lambda t: t[0])


class RoutingRecorder:
    """Counts what megatron-core's routers decide and what each rank's experts receive."""

    def __init__(self, chunks: Sequence[torch.nn.Module], micro_batch_size: int) -> None:
        self.layers = [n for n, _, _ in _moe_layers(chunks)]
        """Global 1-based numbers of this rank's MoE layers."""
        self.micro_batch_size = micro_batch_size
        """Sequences per micro-batch (the routing map's tokens are sequence-major: s x b)."""
        self.steps: list[dict] = []
        """Closed steps: {layer: {"sequences": [[count per expert]], "received": [[...]]}}."""
        self._open = self._empty()
        self._handles: list[RemovableHandle] = []
        for number, router, experts in _moe_layers(chunks):
            self._handles.append(router.register_forward_hook(self._on_route(number)))
            self._handles.append(experts.register_forward_pre_hook(self._on_experts(number)))

    def _empty(self) -> dict:
        return {n: {"sequences": [], "received": []} for n in self.layers}

    def _on_route(self, number: int) -> Hook:
        def hook(_module: torch.nn.Module, _args: Any, output: Any) -> None:
            routing_map = output[1]
            experts = routing_map.shape[-1]
            per_seq = routing_map.reshape(-1, self.micro_batch_size, experts).sum(dim=0)
            self._open[number]["sequences"] += per_seq.to("cpu", torch.int64).tolist()

        return hook

    def _on_experts(self, number: int) -> Hook:
        def hook(_module: torch.nn.Module, args: Any) -> None:
            received = torch.as_tensor(args[1]).to("cpu", torch.int64).reshape(-1)
            self._open[number]["received"].append(received.tolist())

        return hook

    def step(self) -> None:
        """Close the current optimizer step's record."""
        self.steps.append(self._open)
        self._open = self._empty()

    def close(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def rank_record(self) -> dict:
        """This rank's coordinates, layers and steps (plain JSON)."""
        from megatron.core import parallel_state as ps

        return {
            "rank": torch.distributed.get_rank(),
            "tp_rank": ps.get_tensor_model_parallel_rank(),
            "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "dp_rank": ps.get_data_parallel_rank(),
            "cp_rank": ps.get_context_parallel_rank(),
            "ep_rank": ps.get_expert_model_parallel_rank(),
            "layers": self.layers,
            "steps": [{str(n): rec for n, rec in step.items()} for step in self.steps],
        }


def write_routing_stats(path: str, recorder: RoutingRecorder, header: dict) -> None:
    """Gather every rank's record; rank 0 writes `header` plus the ranks to `path`."""
    ranks: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(ranks, recorder.rank_record())
    if torch.distributed.get_rank() != 0:
        return
    data = {**header, "ranks": ranks}
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wt") as f:
        json.dump(data, f)


def read_routing_stats(path: str) -> dict:
    """A file written by write_routing_stats."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)
