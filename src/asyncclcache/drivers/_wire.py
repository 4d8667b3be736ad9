"""Frames on the helper's pipes: a 4-byte length, a JSON header, then raw payloads.

No pickle: the helper and the cache exchange only JSON and bytes.
"""

from __future__ import annotations

import json
import select
import struct
import time
from typing import IO, Any

_LEN = struct.Struct(">I")
_MAX_HEADER = 16 << 20
_MAX_PAYLOAD = 4 << 30


class WireError(EOFError):
    """The other side closed the pipe or sent garbage."""


class WireTimeout(WireError):
    """The other side said nothing in time."""


def _read_exact(f: IO[bytes], n: int, deadline: float | None = None) -> bytes:
    # With a deadline, ``f`` must be unbuffered (select sees the pipe, not a buffer).
    chunks = []
    while n:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([f], [], [], remaining)[0]:
                raise WireTimeout("no answer in time")
        chunk = f.read(n)
        if not chunk:
            raise WireError("pipe closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def send(f: IO[bytes], header: dict[str, Any], payloads: list[bytes] = ()) -> None:  # type: ignore[assignment]
    """Write one frame and flush."""
    header = dict(header, payload=[len(p) for p in payloads])
    data = json.dumps(header).encode("utf-8")
    f.write(_LEN.pack(len(data)) + data)
    for p in payloads:
        f.write(p)
    f.flush()


def recv(f: IO[bytes], timeout: float | None = None) -> tuple[dict[str, Any], list[bytes]]:
    """Read one frame; :class:`WireError` on EOF or garbage, :class:`WireTimeout` when
    ``timeout`` seconds pass first (``f`` unbuffered then)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    (n,) = _LEN.unpack(_read_exact(f, _LEN.size, deadline))
    if n > _MAX_HEADER:
        raise WireError("header too large")
    try:
        header = json.loads(_read_exact(f, n, deadline).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"bad header: {e}") from None
    sizes = header.get("payload", []) if isinstance(header, dict) else None
    if not isinstance(sizes, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= _MAX_PAYLOAD for x in sizes
    ):
        raise WireError("bad header: payload sizes")
    return header, [_read_exact(f, s, deadline) for s in sizes]
