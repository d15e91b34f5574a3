"""A small tmpfs mounted for one test, to run the server on a disk that fills up (root only).

Where mount is not permitted the test skips, unless `CV_REQUIRE_ROOT_MOUNTS=1` (set where the
suite runs as root) makes that a failure.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["fill", "mounted_tmpfs", "run", "unavailable"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=30, check=False)


def unavailable(reason: str) -> None:
    """Skip, or fail where root mounts are required (`CV_REQUIRE_ROOT_MOUNTS=1`)."""
    if os.environ.get("CV_REQUIRE_ROOT_MOUNTS") == "1":
        pytest.fail(f"CV_REQUIRE_ROOT_MOUNTS=1 but {reason}")
    pytest.skip(reason)


@contextlib.contextmanager
def mounted_tmpfs(where: Path, size: int) -> Iterator[Path]:
    """A fresh tmpfs of `size` bytes at `where` (created), unmounted afterwards."""
    where.mkdir(parents=True, exist_ok=True)
    mounted = run("mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where))
    if mounted.returncode != 0:
        unavailable(f"cannot mount a tmpfs (needs root): {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        run("chattr", "-i", *(str(p) for p in where.iterdir()))
        run("umount", "-l", str(where))


def fill(path: Path) -> None:
    """Write `path` until its file system has no byte left."""
    with path.open("wb", buffering=0) as file:
        for chunk in (64 * 1024, 4096, 512, 1):
            with contextlib.suppress(OSError):
                while True:
                    file.write(b"\0" * chunk)
    with contextlib.suppress(OSError):
        path.with_suffix(".probe").write_bytes(b"\0")
    assert os.statvfs(path.parent).f_bavail == 0, errno.ENOSPC
