"""Write the shipped design-shape records (capture_megatron/profile/design/*.jsonl.gz): the
variants of the presets (GPT-3 style and Llama style) under no / selective / full recompute, without
sequence parallelism at TP sizes up to 2 and with it at TP sizes up to 4 (what `profile` probes for
TP <= 2, and for TP >= 4 with --sequence-parallel), on the default GPU kernel set on fake CUDA,
with timelines.

They are measured here with the pinned torch and megatron-core; a file whose key (versions
included) does not match the installed software is never used (capture_megatron.profile.
design_cache).

    python bench/ship_design.py
"""

from __future__ import annotations

import gzip
import os
import tempfile

from capture_megatron.config import Kernels
from capture_megatron.config.kernels import kernel_set
from capture_megatron.config.presets import preset
from capture_megatron.profile import ProfileOptions, profile
from capture_megatron.profile.design import variant_tps
from capture_megatron.profile.design_cache import design_key, load_design
from capture_megatron.records import Variant, write_records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "capture_megatron", "profile", "design")
KERNELS = Kernels().for_gpu()


def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    with tempfile.TemporaryDirectory() as cache:
        os.environ["CAPTURE_MEGATRON_CACHE"] = cache
        for name in ("gpt3-1.3b", "llama2-7b"):
            shape = preset(name)
            for rc in ("none", "selective", "full"):
                for sp, tp in ((False, 2), (True, 4)):
                    variant = Variant.of(shape, rc, sp)
                    options = ProfileOptions(
                        device="fake-cuda", tps=(tp,), variants=(variant,), progress=True
                    )
                    profile(shape, options)  # anchors + design; the design lands in the cache
                    kernels = kernel_set("fake-cuda", KERNELS)
                    key = design_key("fake-cuda", kernels, variant, variant_tps(variant, tp), True)
                    records = load_design(key)
                    assert records, key
                    plain = os.path.join(cache, key + ".plain.jsonl")
                    write_records(records, plain)  # from the cache, or the shipped file
                    with open(plain, "rb") as f:
                        data = f.read()
                    with open(os.path.join(OUT, key + ".jsonl.gz"), "wb") as f:
                        f.write(gzip.compress(data, mtime=0))
                    print(name, rc, sp, key, len(records))


if __name__ == "__main__":
    main()
