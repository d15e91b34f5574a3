"""A server URL that cannot work is refused when the client is made, with a message that says
why: a configuration error, never retried as if the network had failed."""

from __future__ import annotations

import pytest

from cv_workspace_client import WorkspaceClient
from cv_workspace_client._queue.requester import QueueClient

# Pure: no file, socket or database (the `unit` cost mark; see tests/conftest.py).
pytestmark = pytest.mark.unit

BAD_URLS = [
    ("127.0.0.1:8080", "add http://"),
    ("localhost", "http:// or https://"),
    ("ftp://127.0.0.1:21", "http:// or https://"),
    ("http://127.0.0.1:99999", "0..65535"),
    ("http://user:pw@127.0.0.1:8080", "credentials"),
    ("http://127.0.0.1:8080/?x=1", "query"),
]


@pytest.mark.parametrize(("url", "says"), BAD_URLS)
def test_a_url_that_cannot_work_is_refused_at_once(url: str, says: str) -> None:
    for make in (WorkspaceClient, QueueClient):
        with pytest.raises(ValueError, match="server URL") as refused:
            make(url, token="t")
        assert says in str(refused.value)
        assert "pw" not in str(refused.value)


def test_a_path_is_kept_as_a_prefix_and_a_trailing_slash_dropped() -> None:
    client = QueueClient("http://127.0.0.1:8080/cv/", token="t")
    assert client.url == "http://127.0.0.1:8080/cv"
