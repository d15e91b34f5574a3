"""The server URL an SDK client is given, checked once, when the client is made.

A URL that cannot work is a configuration error, not a network blip: `127.0.0.1:8080` (no
scheme) was retried for seconds as if the server were down. It is refused at once with a
`ValueError` that says what is wrong (tests/client/core/test_url.py).
"""

from __future__ import annotations

from urllib.parse import urlsplit

__all__ = ["check_server_url"]


def check_server_url(url: str) -> str:
    """`url` without a trailing slash, or `ValueError` naming what is wrong with it.

    It must be `http://` or `https://` with a host and a port within 0..65535. A path is kept: it
    is a reverse proxy's prefix, put in front of every route. A query or a fragment would send
    every call to the wrong route, and credentials in it would travel beside the bearer token,
    which is the credential; none is quoted back (a query may hold a token)."""
    text = str(url)
    try:
        parts = urlsplit(text)
        host = parts.hostname
        parts.port  # noqa: B018  (raises ValueError when out of range or not a number)
    except ValueError:  # an unbalanced IPv6 bracket, a bad port
        host = None
    if not host or parts.scheme not in ("http", "https"):
        shown = text if "@" not in text else "(a URL with credentials)"
        hint = " (add http://)" if "://" not in text and text else ""
        raise ValueError(
            "the server URL must be an http:// or https:// URL with a host and a port within"
            f" 0..65535, not {shown!r}{hint}"
        )
    if parts.username is not None or parts.password is not None:
        raise ValueError("the server URL must not carry credentials: the token is the credential")
    if parts.query or parts.fragment or text.endswith(("?", "#")):
        raise ValueError("the server URL must not have a query or a fragment")
    return text.rstrip("/")
