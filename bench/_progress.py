"""Progress bars for the benchmarks (tqdm, from the dev extra): one bar per benchmark over its
runs, on stderr, shown only on a terminal, so that the figures on stdout (and a log of a run)
stay as they were."""

from __future__ import annotations

import sys
from typing import Never

from tqdm import tqdm

__all__ = ["runs"]


def runs(total: int, desc: str) -> tqdm[Never]:
    """A bar of `total` runs; call `.update()` after each, use as a context manager."""
    return tqdm(
        total=total,
        desc=desc,
        unit="run",
        file=sys.stderr,
        disable=not sys.stderr.isatty(),
        leave=False,
        dynamic_ncols=True,
    )
