"""What the embedded server repairs when it starts on a file a crashed server left behind."""

from __future__ import annotations

from pathlib import Path

from cv_server import ServerConfig
from cv_server.backends import open_stores
from cv_server.queue import InProgress, Owned


async def test_idempotency_keys_left_in_progress_by_a_crash_are_released_at_start(
    tmp_path: Path,
) -> None:
    config = ServerConfig(db_path=tmp_path / "cv.db", token_secret=b"s" * 32)
    first = await open_stores(config)
    assert isinstance(await first.idempotency.begin("ws1", "k", "fp", 1000.0), Owned)
    assert isinstance(await first.idempotency.begin("ws1", "k", "fp", 1001.0), InProgress)
    await first.close()  # the request never finished: as after a crash, the key stays in progress

    second = await open_stores(config)
    try:
        # A retry of the same request may now run instead of getting 409 for 24 hours.
        assert isinstance(await second.idempotency.begin("ws1", "k", "fp", 1002.0), Owned)
    finally:
        await second.close()
