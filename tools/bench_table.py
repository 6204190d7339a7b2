"""Turns jaxops-bench --json files into the markdown tables of docs/benchmarks.md."""
from __future__ import annotations

import json
import sys


def table(path: str) -> str:
    data = json.load(open(path))
    lines = [
        f"Device: {data['device']}; jax {data['jax']}; {data['date']}; clock: "
        f"{data.get('clock', 'wall')}; copy bandwidth {data['copy_bandwidth'] / 1e12:.2f} TB/s (same run).",
        "",
        "| op | shape | dtype | jaxops µs | XLA µs | speed-up | jaxops / copy | XLA / copy | note |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in data["rows"]:
        shape = "×".join(str(d) for d in r["shape"])
        lines.append(
            f"| {r['op']} | {shape} | {r['dtype']} | {r['jaxops_us']:.1f} | {r['xla_us']:.1f} | "
            f"{r['speedup']:.2f} | {r['jaxops_copy_fraction']:.3f} | {r['xla_copy_fraction']:.3f} | {r['note']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(table(p))
        print()
