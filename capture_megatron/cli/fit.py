"""`capture-megatron fit records.jsonl --out memory_model.json`: fit and report the fit's
quality."""

from __future__ import annotations

from capture_megatron.cli.outputs import prepare_outputs
from capture_megatron.cli.render import print_quality
from capture_megatron.fit import fit, write_model
from capture_megatron.flags.parser import FlagParser, summary
from capture_megatron.records import read_records


def main(argv: list[str]) -> int:
    """Entry point."""
    p = FlagParser(
        prog="capture-megatron fit",
        description=summary(__doc__),
        example="records.jsonl --out memory_model.json",
    )
    p.add_argument("records", help="records file written by `capture-megatron profile`")
    p.add_argument("--out", required=True, help="write the memory model JSON here")
    p.add_argument("--quiet", action="store_true", help="do not print the fit-quality table")
    ns = p.parse_args(argv)
    prepare_outputs(ns)
    model = fit(read_records(ns.records))
    write_model(model, ns.out)
    if not ns.quiet:
        print_quality(model)
    print(f"wrote {ns.out}")
    return 0
