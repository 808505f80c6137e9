"""The rule book: whether a request can be forecast, planned or trained, and if not, why -- in one
place, run once per request (capture_megatron.api runs check_request before anything is
profiled; the planner runs the plan's own rules on the plans it chooses).

- flags: what capture-megatron does with each of Megatron-LM's flags (ignored: cannot change
  memory; refused: changes it in a way not modelled);
- megatron: what Megatron-LM and megatron-core refuse of a model, a plan and the run's options;
- modelled: what each kernel set, device and memory model describes.

Pure Python (no torch).
"""

from capture_megatron.rules.modelled import check_request

__all__ = ["check_request"]
