"""The rule book: whether a request can be forecast, planned or trained, and if not, why -- in one
place, run once per request (capture_megatron.api runs check_request before anything is
profiled; the planner runs the plan's own rules on the plans it chooses).

- flags: what capture-megatron does with each of Megatron-LM's flags (ignored: cannot change
  memory; refused: changes it in a way not modelled; the table is data, flags.json), and what
  Megatron-LM's arguments.py asserts across a command line's flags;
- megatron: what Megatron-LM and megatron-core refuse of a model, a plan and the run's options
  (the features' rules among them: Megatron-FSDP, the optimizers, DeepEP);
- modelled: what each kernel set, device and memory model describes.

Rules that validate one option object's own values run in its constructor (config/, features/,
below the rule book), as Megatron-LM's argparse choices and asserts on one flag do.

Pure Python (no torch).
"""

from capture_megatron.rules.modelled import check_request

__all__ = ["check_request"]
