"""Write the shipped anchor records (capture_megatron/profile/anchors/*.jsonl.gz and index.json):
for each plan of SHIPPED, the records file a cold plan writes into an empty cache (fake CUDA, the
default GPU kernel set), gzipped under its own name, with the plan's command line in index.json.

A shipped file is read only where its name -- the model shape, device, kernel set and software
versions, hashed: capture_megatron.cache.records_path -- matches the user's records file
(capture_megatron.profile.shipped), so it is measured here with the pinned torch and megatron-core
and must be written again when any of those change (tests/unit/test_shipped_anchors.py fails
then). Plans of one model share its file: their records are merged.

    python bench/ship_anchors.py [--only llama3-70b,...] [--index] [--cache DIR]

--only ships those plans again (the others' files stay); --index rewrites index.json alone. The
index is derived from the files shipped, so plans may be shipped by processes side by side.
--cache plans in DIR (made if missing) and keeps it: a run stopped part of the way resumes from
the records it wrote (the time then covers the last run only).
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import shutil
import subprocess
import sys
import time

from plan_times import ISSUE53, ISSUE53_RUN, _fresh_cache

from capture_megatron.api.request import cluster_of, read_request
from capture_megatron.cache import records_path
from capture_megatron.cli.plan import build_parser
from capture_megatron.config.kernels import kernel_set
from capture_megatron.profile.shipped import SWITCH
from capture_megatron.records import read_records, write_records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "capture_megatron", "profile", "anchors")
RESULTS = os.path.join(ROOT, "bench", "results", "ship_anchors.json")
"""Each shipped plan's records, size and cold time (one run, from nothing)."""
SHIPPED = {
    name: [*flags, *ISSUE53_RUN, "--gpus", str(gpus)] for name, (flags, gpus) in ISSUE53.items()
}
"""The plans whose records are shipped (name: `plan` flags): issue 53's."""


def _relative(argv: list[str]) -> list[str]:
    """The flags with paths inside the repository made relative to it (the index is portable)."""
    return [os.path.relpath(a, ROOT) if a.startswith(ROOT) else a for a in argv]


def records_file(argv: list[str]) -> str:
    """The name of the records file a fake-CUDA plan of `argv` reads and writes."""
    ns = build_parser().parse_args(argv)
    request = read_request(ns, cluster_of(ns), False, None)
    kernels = kernel_set("fake-cuda", request.options.kernels)
    return os.path.basename(records_path(request.shape, "fake-cuda", kernels))


def ship(name: str, argv: list[str], kept: str = "") -> None:
    """Plan `argv` cold and ship the records file it wrote (merged into one shipped already);
    `kept`: the cache to plan in and keep (else a fresh one, removed)."""
    cache = kept or _fresh_cache()
    if kept and not os.path.isdir(kept):
        shutil.move(_fresh_cache(), kept)  # with the compiled shim, as a fresh one
    try:
        env = {**os.environ, "CAPTURE_MEGATRON_CACHE": cache, SWITCH: "0"}
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "capture_megatron.cli", "plan", *argv, "--no-progress"]
        subprocess.run(cmd, check=True, env=env, capture_output=True)
        path = os.path.join(cache, records_file(argv))
        records = read_records(path)
        target = os.path.join(OUT, os.path.basename(path) + ".gz")
        if os.path.exists(target):  # another plan of the same model: merged
            with gzip.open(target, "rb") as f, open(path + ".old", "wb") as g:
                g.write(f.read())
            pairs = {(r.variant, r.shape) for r in records}
            records += [r for r in read_records(path + ".old") if (r.variant, r.shape) not in pairs]
        write_records(records, path)
        with open(path, "rb") as f:
            data = gzip.compress(f.read(), mtime=0)
        with open(target, "wb") as f:
            f.write(data)
        seconds = time.perf_counter() - t0
        print(
            f"{name}: {len(records)} records, {len(data) // 1024} KiB, {seconds:.0f} s", flush=True
        )
        _record(name, len(records), len(data), seconds)
    finally:
        if not kept:
            shutil.rmtree(cache, ignore_errors=True)


def _record(name: str, records: int, nbytes: int, seconds: float) -> None:
    """Add the cold plan's row to RESULTS (its time is a cold plan from nothing: one run)."""
    rows = {}
    if os.path.exists(RESULTS):
        with open(RESULTS) as f:
            rows = {r["plan"]: r for r in json.load(f)["plans"]}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    rows[name] = {
        "plan": name,
        "records": records,
        "gzip_bytes": nbytes,
        "cold_from_nothing_s": seconds,
        "load_average_5min_end": os.getloadavg()[1],
        "commit": commit.stdout.strip(),
    }
    with open(RESULTS, "w") as f:
        json.dump({"plans": [rows[n] for n in SHIPPED if n in rows]}, f, indent=1)


def write_index() -> None:
    """index.json: each shipped file's plans (SHIPPED's whose records file it is)."""
    index: dict = {}
    for name, argv in SHIPPED.items():
        file = records_file(argv) + ".gz"
        if os.path.exists(os.path.join(OUT, file)):
            index.setdefault(file, {"plans": {}})["plans"][name] = _relative(argv)
    with open(os.path.join(OUT, "index.json"), "w") as f:
        json.dump(index, f, indent=1, sort_keys=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--only", default="", help="names of SHIPPED to (re)ship, comma-separated")
    ap.add_argument("--index", action="store_true", help="write index.json only")
    ap.add_argument("--cache", default="", help="plan in this cache and keep it (resumable)")
    ns = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    if not ns.only and not ns.index:  # every file written again: none of another version's left
        for old in glob.glob(os.path.join(OUT, "*.jsonl.gz")):
            os.remove(old)
    for name in [] if ns.index else ns.only.split(",") if ns.only else SHIPPED:
        ship(name, SHIPPED[name], os.path.abspath(ns.cache) if ns.cache else "")
        write_index()  # from the files shipped: plans shipped side by side list each other's
    write_index()


if __name__ == "__main__":
    main()
