"""Reading compiled HLO text: what the sharding tests and the scaling benchmark check."""
from __future__ import annotations

import math
import re


def gather_sizes(hlo: str) -> list[int]:
    """Element counts of every all-gather result in compiled HLO text (the largest array of a
    tuple-shaped result)."""
    sizes = []
    for line in hlo.splitlines():
        m = re.search(r"=\s*(.*?)\s+all-gather(?:-start)?\(", line)
        if m:
            dims = re.findall(r"\w+\[([\d,]*)\]", m.group(1))
            sizes.append(max(math.prod(int(d) for d in ds.split(",") if d) for ds in dims))
    return sizes
