"""Frames on the helper's pipes: a 4-byte length, a JSON header, then raw payloads.

No pickle: the helper and the cache exchange only JSON and bytes.
"""

from __future__ import annotations

import json
import struct
from typing import IO, Any

_LEN = struct.Struct(">I")
_MAX_HEADER = 16 << 20


class WireError(EOFError):
    """The other side closed the pipe or sent garbage."""


def _read_exact(f: IO[bytes], n: int) -> bytes:
    chunks = []
    while n:
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


def recv(f: IO[bytes]) -> tuple[dict[str, Any], list[bytes]]:
    """Read one frame; :class:`WireError` on EOF or garbage."""
    (n,) = _LEN.unpack(_read_exact(f, _LEN.size))
    if n > _MAX_HEADER:
        raise WireError("header too large")
    try:
        header = json.loads(_read_exact(f, n).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"bad header: {e}") from None
    sizes = header.get("payload", [])
    return header, [_read_exact(f, s) for s in sizes]
