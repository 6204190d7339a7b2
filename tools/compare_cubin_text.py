#!/usr/bin/env python3
"""Which kernels' machine code differs between two cubins (``nvcc -cubin`` outputs).

Compares the ELF ``.text.<mangled kernel name>`` sections byte for byte, so it needs no
disassembler (this build machine has neither cuobjdump nor nvdisasm). Use it to check that a
refactor leaves existing kernels' code unchanged:

    nvcc -std=c++17 -O3 --expt-relaxed-constexpr -arch=sm_90 -I cc -I third_party/xla_ffi/include \\
        -cubin -o /tmp/new.cubin cc/layer_norm/layer_norm_bwd.cu      # and the same at the old commit
    python3 tools/compare_cubin_text.py /tmp/old.cubin /tmp/new.cubin \\
        --rename 'EEEvNS0_12BackwardArgsEl$=ELb0EEEvNS0_12BackwardArgsEl'

``--rename OLD=NEW`` (repeatable; a regular expression and its replacement) renames an old kernel
that has no namesake in the new cubin when the renamed one exists there: for kernels that gained a
defaulted template parameter (their mangled names change). Prints the kernels that differ or exist
on one side only; exit status 1 if any differ.
"""
from __future__ import annotations

import argparse
import re
import struct
import sys


def text_sections(path: str) -> dict[str, bytes]:
    """Name -> bytes of every .text.* section of a 64-bit little-endian ELF file."""
    data = open(path, "rb").read()
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]
    out = {}
    for name_off, kind, _, _, offset, size, *_ in headers:
        name = data[names_at + name_off:data.index(b"\0", names_at + name_off)].decode()
        if name.startswith(".text.") and kind != 8:  # 8: SHT_NOBITS
            out[name[len(".text."):]] = data[offset:offset + size]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--rename", action="append", default=[], metavar="OLD=NEW")
    args = parser.parse_args()
    old, new = text_sections(args.old), text_sections(args.new)
    for rule in args.rename:
        a, b = rule.split("=", 1)
        renamed = {}
        for k, v in old.items():
            r = re.sub(a, b, k)
            renamed[r if k not in new and r in new else k] = v
        old = renamed
    differ = sorted(k for k in old.keys() & new.keys() if old[k] != new[k])
    for k in differ:
        print(f"differs    {k} ({len(old[k])} -> {len(new[k])} bytes)")
    for k in sorted(old.keys() - new.keys()):
        print(f"old only   {k}")
    for k in sorted(new.keys() - old.keys()):
        print(f"new only   {k}")
    print(f"{len(old.keys() & new.keys())} kernels in both, {len(differ)} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
