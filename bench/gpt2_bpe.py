"""GPT-2's BPE files (vocab.json, merges.txt) from a tiktoken rank file, for benchmarks that need
the tokenizer Megatron-LM's GPT functional tests use (GPT2BPETokenizer) on a machine that cannot
download it. openai-whisper's package ships GPT-2's ranks as whisper/assets/gpt2.tiktoken
(`pip download --no-deps openai-whisper`, then take that file from the archive).

    python bench/gpt2_bpe.py gpt2.tiktoken OUT_DIR

Each multi-byte token's merge is recovered by running byte-pair merges on its bytes with the ranks
below its own until two parts remain (the parts it was merged from); tokens are written in GPT-2's
byte-to-unicode alphabet, and <|endoftext|> takes the id after the ranks (50256).
"""

from __future__ import annotations

import base64
import json
import os
import sys


def byte_alphabet() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (bytes_to_unicode of its encoder.py)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += list(range(ord("®"), ord("ÿ") + 1))
    chars = dict(zip(keep, map(chr, keep)))
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def read_ranks(path: str) -> dict[bytes, int]:
    """token bytes -> rank of a tiktoken file (base64 token, rank per line)."""
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


def parts_of(token: bytes, rank: int, ranks: dict[bytes, int]) -> list[bytes]:
    """The token's bytes merged by every rank below `rank`, lowest first."""
    parts = [bytes([b]) for b in token]
    while True:
        best = None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < rank and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            return parts
        i = best[1]
        parts = [*parts[:i], parts[i] + parts[i + 1], *parts[i + 2 :]]


def write_files(ranks: dict[bytes, int], out: str) -> tuple[int, int]:
    """Write vocab.json and merges.txt under `out`; (vocabulary, merges)."""
    alphabet = byte_alphabet()

    def text(b: bytes) -> str:
        return "".join(alphabet[x] for x in b)

    vocab = {text(t): r for t, r in ranks.items()}
    vocab["<|endoftext|>"] = len(ranks)
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) > 1:
            a, b = parts_of(token, rank, ranks)
            merges.append(f"{text(a)} {text(b)}")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "vocab.json"), "w") as f:
        json.dump(vocab, f)
    with open(os.path.join(out, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n" + "\n".join(merges) + "\n")
    return len(vocab), len(merges)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    n, m = write_files(read_ranks(sys.argv[1]), sys.argv[2])
    print(f"wrote {sys.argv[2]}: vocabulary {n}, merges {m}")
