"""Request bodies: every route reads its body through `read_body`, which decodes the content
coding itself and holds the body limit on the decoded size (docs/limits.md).

aiohttp's own decoding is switched off (`create_app` sets `auto_decompress=False`): it let a body
that was not what its `Content-Encoding` claimed escape as an unhandled `zlib.error` (a 500, which
clients retry), answered `br` and `zstd` with a text/plain 400 from its parser, and read an
unknown coding (`compress`) or a stack of two as if there were none. Here: `identity`, `gzip`
(and its alias `x-gzip`) and `deflate` are accepted, one coding at most; anything else is 415
`unsupported_content_encoding`, a body that does not decode is 400 `malformed_body`, and one that
decodes past the limit is 413 `body_too_large` as soon as it does (a gzip bomb is never inflated
past the limit). Pinned by tests/server/http/test_bodies.py.

Every body is JSON, and its `Content-Type` may not say otherwise (docs/protocol.md, "Headers"):
`application/json` or a `+json` type (`application/merge-patch+json`), in UTF-8 if it names a
charset, or no `Content-Type` at all (HTTP lets a sender leave it out; the route says what it
reads). Anything else (`text/plain`, a form, `application/octet-stream`) is 415
`unsupported_media_type` with `Accept: application/json`, before a byte is read. Pinned by
tests/server/http/test_media_types.py.
"""

from __future__ import annotations

import zlib
from typing import Final

from aiohttp import hdrs, web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from cv_server.http.problems import Problem
from cv_server.keys import CONFIG

__all__ = [
    "ACCEPTED_ENCODINGS",
    "ACCEPTED_MEDIA_TYPE",
    "decode_body",
    "is_json_media_type",
    "read_body",
]

#: The content codings a request body may carry, as `Accept-Encoding` lists them on a 415.
ACCEPTED_ENCODINGS: Final = ("gzip", "deflate", "identity")

#: The media type of every body, as `Accept` names it on a 415.
ACCEPTED_MEDIA_TYPE: Final = "application/json"

#: Coding name (lower case) → zlib `wbits` of its decoder. `deflate` is the zlib format
#: (RFC 9110 §8.4.1.2); a raw deflate stream, which some clients send under that name, is read
#: too, as aiohttp did (`_decoder`).
_WBITS: Final = {
    "gzip": 16 + zlib.MAX_WBITS,
    "x-gzip": 16 + zlib.MAX_WBITS,
    "deflate": zlib.MAX_WBITS,
}

#: Output asked of the decoder per step: a step never holds more than this beyond the limit.
_STEP: Final = 64 * 1024


def _coding(header: str | None) -> str | None:
    """The one coding to undo (None for none), or 415 for one the server does not decode."""
    if header is None:
        return None
    codings = [part.strip().lower() for part in header.split(",") if part.strip()]
    codings = [coding for coding in codings if coding != "identity"]
    if not codings:
        return None
    if len(codings) > 1 or codings[0] not in _WBITS:
        raise Problem(
            415,
            "unsupported_content_encoding",
            f"Content-Encoding {header[:64]!r} is not accepted: send one of "
            f"{', '.join(ACCEPTED_ENCODINGS)}",
            headers={hdrs.ACCEPT_ENCODING: ", ".join(ACCEPTED_ENCODINGS)},
        )
    return codings[0]


def is_json_media_type(media_type: str, charset: str | None) -> bool:
    """Whether a body of `media_type` (lower case, parameters apart) and `charset` is read as
    JSON: `application/json` or `application/*+json`, in UTF-8 (JSON's only encoding between
    systems, RFC 8259) when a charset is named."""
    kind, _, subtype = media_type.partition("/")
    if kind != "application" or not (subtype == "json" or subtype.endswith("+json")):
        return False
    return charset is None or charset.lower() in ("utf-8", "utf8")


def _check_media_type(request: web.Request) -> None:
    """415 `unsupported_media_type` for a body whose `Content-Type` is not JSON."""
    header = request.headers.get(hdrs.CONTENT_TYPE)
    if header is None or not request.body_exists:
        return
    if not is_json_media_type(request.content_type, request.charset):
        raise Problem(
            415,
            "unsupported_media_type",
            f"Content-Type {header[:64]!r} is not accepted: send {ACCEPTED_MEDIA_TYPE}",
            headers={hdrs.ACCEPT: ACCEPTED_MEDIA_TYPE},
        )


def _decoder(coding: str, first: int) -> zlib._Decompress:
    wbits = _WBITS[coding]
    if coding == "deflate" and first & 0x0F != 8:  # no zlib header: a raw deflate stream
        wbits = -zlib.MAX_WBITS
    return zlib.decompressobj(wbits=wbits)


def decode_body(coding: str, raw: bytes, limit: int) -> bytes:
    """`raw` decoded from `coding`, or a `Problem`: 413 once the output passes `limit` bytes,
    400 `malformed_body` if it is not a complete stream of that coding (truncated, corrupt, or
    followed by bytes that are not another gzip member)."""
    out = bytearray()
    data = raw
    while data:
        decoder = _decoder(coding, data[0])
        try:
            while data and not decoder.eof:
                out += decoder.decompress(data, _STEP)
                data = decoder.unconsumed_tail
                if len(out) > limit:
                    raise Problem(
                        413,
                        "body_too_large",
                        f"the body decodes to more than {limit} bytes (the server's limit)",
                    )
        except zlib.error:
            raise Problem(400, "malformed_body", f"the body is not valid {coding} data") from None
        if not decoder.eof:
            raise Problem(400, "malformed_body", f"the {coding} body is truncated")
        data = decoder.unused_data
        if data and coding == "deflate":  # gzip allows several members; deflate is one stream
            raise Problem(400, "malformed_body", "bytes follow the end of the deflate stream")
    return bytes(out)


async def read_body(request: web.Request, *, limit: int | None = None) -> bytes:
    """The request's body, decoded. Raises the `Problem` for a media type that is not JSON or a
    coding the server does not decode (both checked before any byte is read), a body that does
    not decode, or one too large before or after decoding.

    `limit` is a route's own bound on the body, before and after decoding, in place of the
    server's `max_body_bytes` (the result upload's `max_result_bytes`, docs/queue.md)."""
    _check_media_type(request)
    coding = _coding(request.headers.get(hdrs.CONTENT_ENCODING))
    bound = request.app[CONFIG].max_body_bytes if limit is None else limit
    try:
        raw = await request.read() if limit is None else await _read_within(request, limit)
    except web.HTTPRequestEntityTooLarge as exc:
        raise Problem(413, "body_too_large", exc.text or "") from None
    except (RequestPayloadError, HttpProcessingError) as exc:
        # The framing of the body itself was broken (a bad chunk size, a short body).
        reason = type(exc).__name__
        raise Problem(400, "malformed_body", f"the body could not be read ({reason})") from None
    if coding is None or not raw:
        return raw
    return decode_body(coding, raw, bound)


async def _read_within(request: web.Request, limit: int) -> bytes:
    """The raw body, refused with 413 `body_too_large` as soon as it passes `limit` bytes: by
    its Content-Length before anything is read, else while it arrives. aiohttp's own bound
    (`client_max_size`, the server's `max_body_bytes`) does not apply to a body read this way."""
    too_large = Problem(413, "body_too_large", f"the body is larger than {limit} bytes")
    declared = request.content_length
    if declared is not None and declared > limit:
        raise too_large
    received = bytearray()
    async for chunk in request.content.iter_chunked(_STEP):
        received += chunk
        if len(received) > limit:
            raise too_large
    return bytes(received)
