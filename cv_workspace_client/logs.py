"""Log lines for the long-running commands (`cv-worker`, `cv-server serve`): `--log-format json`
or `text`, context fields and redaction. Defined in `cv_mutations.logs`, which the server's
commands import too; re-exported here, the SDK's documented path. See docs/observability.md.
"""

from __future__ import annotations

from cv_mutations.logs import (
    LOG_FORMATS,
    JsonFormatter,
    LogFormat,
    TextFormatter,
    configure_logging,
    context_fields,
    log_context,
    redact,
)

__all__ = [
    "LOG_FORMATS",
    "JsonFormatter",
    "LogFormat",
    "TextFormatter",
    "configure_logging",
    "context_fields",
    "log_context",
    "redact",
]
