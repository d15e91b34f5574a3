"""Settings that cannot work are refused at start-up, naming the setting, instead of being served
(every lock acquisition a 500, every enqueue or apply refused as if the client were wrong)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from cv_server import ServerConfig


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("compute_lock_ttl_seconds", 0.0),
        ("max_dequeues", 0),
        ("max_ops_per_request", 0),
        ("lease_seconds", -1.0),
        ("waiter_deadline_seconds", math.nan),
        ("sweep_seconds", math.inf),
        ("drain_seconds", -0.5),
        ("blob_threshold_bytes", -1),
    ],
)
def test_a_setting_that_cannot_work_is_refused_naming_it(name: str, value: float) -> None:
    with pytest.raises(ValueError, match=name):
        ServerConfig(**{name: value})  # type: ignore[arg-type]


def test_zero_is_accepted_where_it_means_something() -> None:
    config = ServerConfig(failure_backoff_seconds=0.0, blob_threshold_bytes=0, drain_seconds=0.0)
    assert (config.failure_backoff_seconds, config.blob_threshold_bytes, config.drain_seconds) == (
        0.0,
        0,
        0.0,
    )


def test_serve_refuses_such_a_setting_in_one_line_before_opening_anything(tmp_path: Path) -> None:
    db = tmp_path / "cv.db"
    argv = ["serve", "--db", str(db), "--port", "0", "--set", "compute_lock_ttl_seconds=0"]
    # A process of its own, bounded: had it accepted the setting, it would serve until killed.
    done = subprocess.run(
        [sys.executable, "-m", "cv_server.cli", *argv], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "compute_lock_ttl_seconds" in lines[0]
    assert not db.exists()  # refused before the database was created
