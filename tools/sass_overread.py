#!/usr/bin/env python3
"""Flags shared-memory vector loads that cover bytes their base register never stores nearby.

ptxas may widen scalar shared loads into one 16-byte load that starts or ends on a neighbour's
word (session 57: backward_block_skew read the previous thread's last column, which racecheck
reports as a race). Read-modify-write loops over shared accumulators show it as an LDS.64 / LDS.128
of which only some bytes are stored back through the same base register. A heuristic over the
next `--window` instructions, stopping where the base register is rewritten or at a branch target;
check what it prints by hand.

  nvcc ... -cubin -o k.cubin && nvdisasm -c k.cubin > k.sass && tools/sass_overread.py k.sass
(nvdisasm: the CUDA toolkit, or pip's nvidia-cuda-nvdisasm.)
"""
from __future__ import annotations

import argparse
import re

ACCESS = re.compile(r"(LDS|STS)(\.64|\.128)?\s+(?:(R\d+),\s*)?\[(R\d+)(?:\+0x([0-9a-f]+))?\]")
INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s+(R\d+)?")
WIDTH = {None: 4, ".64": 8, ".128": 16}


def _defined(line: str) -> set[str]:
    """Registers an instruction writes (its first operand, widened for 64 / 128-bit results)."""
    m = INSTRUCTION.match(line)
    if not m or not m.group(2) or m.group(1).split(".")[0] in ("STS", "STG", "ST", "STL", "RED", "BRA"):
        return set()
    first = int(m.group(2)[1:])
    op = m.group(1)
    n = 4 if ".128" in op else 2 if (".64" in op or ".WIDE" in op) else 1
    return {f"R{first + k}" for k in range(n)}


def widened_loads(lines: list[str], window: int) -> list[tuple[int, str, list[int]]]:
    """(line number, instruction, stored words) of each suspicious vector load: a read-modify-write
    through one base register (some of the loaded bytes are stored back through it before it is
    written again) whose load covers bytes that are not stored back."""
    found = []
    for i, line in enumerate(lines):
        m = ACCESS.search(line)
        if not m or m.group(1) != "LDS" or not m.group(2):
            continue
        base, off = m.group(4), int(m.group(5) or "0", 16)
        if base in _defined(line):  # the load overwrites its own address register
            continue
        loaded = set(range(off, off + WIDTH[m.group(2)]))
        stored: set[int] = set()
        for later in lines[i + 1:i + window]:
            s = ACCESS.search(later)
            if s and s.group(1) == "STS" and s.group(4) == base:
                o = int(s.group(5) or "0", 16)
                stored |= set(range(o, o + WIDTH[s.group(2)]))
            if base in _defined(later) or later.lstrip().startswith(".L_x"):
                break  # a new value of the base, or a branch target: stop
        if loaded & stored and not loaded <= stored:  # part of the load is written back: an RMW
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
