"""Benchmark cases of this family (none yet)."""
from jaxops.bench.case import Case, Options


def cases(options: Options) -> list[Case]:
    return []
