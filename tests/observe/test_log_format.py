"""`cv_workspace_client.logs`: the JSON and text line formats, context fields and redaction."""

from __future__ import annotations

import io
import json
import logging
import sys
import threading
from collections.abc import Iterator

import pytest

from cv_workspace_client.logs import configure_logging, log_context, redact

TOKEN = "cvt1.eyJ3cyI6WyIqIl19.c2lnbmF0dXJlLWJ5dGVz"


@pytest.fixture
def restore_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    hooks = sys.excepthook, sys.unraisablehook, threading.excepthook
    yield
    sys.excepthook, sys.unraisablehook, threading.excepthook = hooks
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(False)


@pytest.mark.parametrize(
    "text",
    [
        f"Authorization: Bearer {TOKEN}",
        f"GET /v1/workspaces/w/socket?token={TOKEN}&batch=1",
        f'{{"claim_token": "{TOKEN}"}}',
        f"a token {TOKEN} in a message",
        "api_key=sk-abcdefghijklmnop1234",
        "OPENAI key sk-abcdefghijklmnop1234 leaked",
        "secret=hunter2hunter2",
    ],
)
def test_redact_removes_every_credential_shape(text: str) -> None:
    cleaned = redact(text)
    assert "<redacted>" in cleaned
    for secret in (TOKEN, "c2lnbmF0dXJlLWJ5dGVz", "sk-abcdefghijklmnop1234", "hunter2"):
        assert secret not in cleaned


def test_redact_leaves_ordinary_text_alone() -> None:
    text = "queue claimed r_0123 stage=enrich status=in_progress"
    assert redact(text) == text


@pytest.mark.usefixtures("restore_root")
def test_json_lines_carry_fields_context_and_one_line_tracebacks() -> None:
    out = io.StringIO()
    configure_logging("json", "DEBUG", stream=out)
    log = logging.getLogger("t")
    with log_context(queue_request_id="r_1"):
        log.info("hello %s", "there", extra={"route": "/x/{id}", "status": 200})
    try:
        raise ValueError(f"boom {TOKEN}")
    except ValueError:
        log.exception("failed")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    first, second = map(json.loads, lines)
    assert first["message"] == "hello there"
    assert first["level"] == "INFO"
    assert first["logger"] == "t"
    assert first["ts"].endswith("Z")
    assert (first["route"], first["status"], first["queue_request_id"]) == ("/x/{id}", 200, "r_1")
    assert "queue_request_id" not in second  # outside the context
    assert "ValueError" in second["exc"]
    assert TOKEN not in lines[1]


@pytest.mark.usefixtures("restore_root")
def test_text_lines_append_fields_as_key_value() -> None:
    out = io.StringIO()
    configure_logging("text", "INFO", stream=out)
    logging.getLogger("t").debug("not shown")
    logging.getLogger("t").info("hi", extra={"route": "/a b", "status": 200})
    (line,) = out.getvalue().splitlines()
    assert line.endswith('INFO t: hi route="/a b" status=200')


def test_an_unknown_level_or_format_is_refused() -> None:
    with pytest.raises(ValueError, match="level"):
        configure_logging("json", "LOUD")
    with pytest.raises(ValueError, match="format"):
        configure_logging("xml", "INFO")  # type: ignore[arg-type]


@pytest.mark.usefixtures("restore_root")
def test_an_exception_in_a_thread_is_one_json_line() -> None:
    out = io.StringIO()
    configure_logging("json", "INFO", stream=out)

    def boom() -> None:
        raise RuntimeError(f"thread failed with {TOKEN}")

    thread = threading.Thread(target=boom, name="t1")
    thread.start()
    thread.join()
    (line,) = out.getvalue().splitlines()
    record = json.loads(line)
    assert record["level"] == "CRITICAL"
    assert "RuntimeError" in record["exc"]
    assert TOKEN not in line
