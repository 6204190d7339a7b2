#!/usr/bin/env python3
"""Flags shared-memory vector loads that cover bytes their base register never stores nearby.

ptxas may widen scalar shared loads into one 16-byte load that starts or ends on a neighbour's
word (session 57: backward_block_skew read the previous thread's last column, which racecheck
reports as a race). Read-modify-write loops over shared accumulators show it as an LDS.64 / LDS.128
whose bytes are not all stored back through the same base. Heuristic: also prints loads whose base
register is reused for other stores (check those by hand).

  nvcc ... -cubin -o k.cubin && nvdisasm -c k.cubin > k.sass && tools/sass_overread.py k.sass
(nvdisasm: the CUDA toolkit, or pip's nvidia-cuda-nvdisasm.)
"""
from __future__ import annotations

import argparse
import re

ACCESS = re.compile(r"(LDS|STS)(\.64|\.128)?\s+(?:R\d+,\s*)?\[(R\d+)(?:\+0x([0-9a-f]+))?\]")
WIDTH = {None: 4, ".64": 8, ".128": 16}


def widened_loads(lines: list[str], window: int) -> list[tuple[int, str, list[int]]]:
    """(line number, instruction, stored words) of each suspicious vector load."""
    found = []
    for i, line in enumerate(lines):
        m = ACCESS.search(line)
        if not m or m.group(1) != "LDS" or not m.group(2):
            continue
        base, off = m.group(3), int(m.group(4) or "0", 16)
        loaded = set(range(off, off + WIDTH[m.group(2)]))
        stored: set[int] = set()
        for later in lines[i:i + window]:
            s = ACCESS.search(later)
            if s and s.group(1) == "STS" and s.group(3) == base:
                o = int(s.group(4) or "0", 16)
                stored |= set(range(o, o + WIDTH[s.group(2)]))
        if stored and not loaded <= stored:
            found.append((i + 1, line.strip(), sorted({b // 4 * 4 for b in stored})))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sass", help="nvdisasm -c output")
    parser.add_argument("--window", type=int, default=300, help="instructions after a load to look for its stores")
    args = parser.parse_args()
    with open(args.sass) as f:
        lines = f.read().splitlines()
    found = widened_loads(lines, args.window)
    for n, text, stored in found:
        print(f"{n}: {text}   stored words at {stored}")
    print(f"{len(found)} flagged")


if __name__ == "__main__":
    main()
