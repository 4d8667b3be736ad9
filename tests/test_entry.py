"""The entry format: a round trip, and every kind of damage is an EntryFormatError."""

from __future__ import annotations

import hashlib
import io
import json
import struct

import pytest

from asyncclcache.entry import MAGIC, Entry, EntryFormatError, EntryMeta, decode, encode, read_meta
from asyncclcache.keys import FORMAT_VERSION

HEADER = struct.Struct("<8sHHI")
DIGEST = 32

KEY = hashlib.sha256(b"test_entry").hexdigest()


def _entry(n_binaries: int = 2) -> Entry:
    binaries = tuple(bytes([i]) * (40 + 7 * i) + b"\x00\xff" for i in range(n_binaries))
    meta = {
        "devices": [{"device_name": f"dev{i}"} for i in range(n_binaries)],
        "options": "-DX=1",
        "build_logs": ["", "warning: \u00e9"],
        "created": 1234.5,
    }
    return Entry(KEY, binaries, meta)


def _reseal(body: bytes) -> bytes:
    """Append a correct checksum, so that only the structure is wrong."""
    return body + hashlib.blake2b(body, digest_size=DIGEST).digest()


def _parts(data: bytes) -> tuple[bytes, bytes, bytes]:
    """(header, metadata, binaries) of a valid encoded entry."""
    meta_len = HEADER.unpack_from(data)[3]
    return (
        data[: HEADER.size],
        data[HEADER.size : HEADER.size + meta_len],
        data[HEADER.size + meta_len : -DIGEST],
    )


def test_round_trip() -> None:
    entry = _entry()
    data = encode(entry)
    assert data.startswith(MAGIC)
    back = decode(data)
    assert back.key == entry.key
    assert back.binaries == entry.binaries
    assert back.nbytes == entry.nbytes == sum(len(b) for b in entry.binaries)
    for name, value in entry.meta.items():
        assert back.meta[name] == value
    assert back.meta == entry.meta
    assert (back.meta.options, back.meta.created, back.meta.build_logs) == (
        "-DX=1", 1234.5, ["", "warning: \u00e9"])
    # The framing fields are in the stored JSON, not in the metadata readers see.
    stored = json.loads(_parts(data)[1])
    assert (stored["key"], stored["format"]) == (KEY, FORMAT_VERSION)
    assert stored["binary_sizes"] == [len(b) for b in entry.binaries]
    assert "format" not in back.meta
    # Stable: encoding the decoded entry gives the same bytes.
    assert encode(back) == data


@pytest.mark.parametrize("n", [0, 1, 3])
def test_round_trip_binary_counts(n: int) -> None:
    entry = _entry(n)
    assert decode(encode(entry)).binaries == entry.binaries


def test_round_trip_empty_binary_and_bytearray_input() -> None:
    entry = Entry(KEY, (b"", b"x"), {})
    back = decode(bytes(bytearray(encode(entry))))
    assert back.binaries == (b"", b"x")


def test_encode_does_not_change_the_entry() -> None:
    entry = _entry()
    before = dict(entry.meta)
    encode(entry)
    assert entry.meta == before


def test_empty() -> None:
    with pytest.raises(EntryFormatError, match="truncated"):
        decode(b"")


def test_truncated_at_every_length() -> None:
    data = encode(_entry())
    for n in range(len(data)):
        with pytest.raises(EntryFormatError):
            decode(data[:n])


def test_trailing_garbage() -> None:
    with pytest.raises(EntryFormatError):
        decode(encode(_entry()) + b"\x00")


def test_one_flipped_byte_anywhere() -> None:
    data = encode(_entry())
    for i in range(len(data)):
        for bit in (0x01, 0x80):
            damaged = bytearray(data)
            damaged[i] ^= bit
            with pytest.raises(EntryFormatError):
                decode(bytes(damaged))


def test_wrong_magic() -> None:
    data = encode(_entry())
    with pytest.raises(EntryFormatError, match="magic"):
        decode(b"XLCACHE!" + data[8:])
    # Even with a checksum that matches the damaged bytes.
    with pytest.raises(EntryFormatError, match="magic"):
        decode(_reseal(b"XLCACHE!" + data[8:-DIGEST]))


@pytest.mark.parametrize("version", [0, FORMAT_VERSION + 1, 0xFFFF])
def test_wrong_version(version: int) -> None:
    header, meta, binaries = _parts(encode(_entry()))
    bad_header = HEADER.pack(MAGIC, version, 0, len(meta))
    assert bad_header != header
    with pytest.raises(EntryFormatError, match="version"):
        decode(_reseal(bad_header + meta + binaries))


@pytest.mark.parametrize(
    "delta",
    [-1, 1, -10, 10_000, 1 << 30, 0xFFFFFFFF],
    ids=["one-short", "one-long", "short", "past-end", "huge", "max"],
)
def test_metadata_length_lies(delta: int) -> None:
    _header, meta, binaries = _parts(encode(_entry()))
    meta_len = min(max(len(meta) + delta, 0), 0xFFFFFFFF)
    lying = HEADER.pack(MAGIC, FORMAT_VERSION, 0, meta_len) + meta + binaries
    # Unsealed, the checksum catches it; sealed, the structure checks must.
    with pytest.raises(EntryFormatError):
        decode(lying + encode(_entry())[-DIGEST:])
    with pytest.raises(EntryFormatError):
        decode(_reseal(lying))


def test_metadata_length_zero() -> None:
    _header, meta, binaries = _parts(encode(_entry()))
    with pytest.raises(EntryFormatError):
        decode(_reseal(HEADER.pack(MAGIC, FORMAT_VERSION, 0, 0) + meta + binaries))


def _sealed_with_meta(
    meta_obj: object, binaries: bytes = b"abc", raw: bytes | None = None
) -> bytes:
    meta = raw if raw is not None else json.dumps(meta_obj).encode()
    return _reseal(HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(meta)) + meta + binaries)


@pytest.mark.parametrize(
    ("meta", "raw"),
    [
        (None, b"\xff\xfe not utf-8"),
        (None, b"{not json"),
        ([1, 2, 3], None),
        ({"binary_sizes": [3]}, None),  # no key
        ({"key": 5, "binary_sizes": [3]}, None),
        ({"key": KEY}, None),  # no sizes
        ({"key": KEY, "binary_sizes": 3}, None),
        ({"key": KEY, "binary_sizes": [-1, 4]}, None),
        ({"key": KEY, "binary_sizes": ["3"]}, None),
        ({"key": KEY, "binary_sizes": [2]}, None),  # sizes do not add up
        ({"key": KEY, "binary_sizes": [4]}, None),
    ],
)
def test_bad_metadata(meta: object, raw: bytes | None) -> None:
    with pytest.raises(EntryFormatError):
        decode(_sealed_with_meta(meta, raw=raw))


def test_sealed_good_metadata_decodes() -> None:
    # The helper itself builds decodable entries: the failures above are the metadata's.
    entry = decode(_sealed_with_meta({"key": KEY, "binary_sizes": [1, 2]}))
    assert entry.binaries == (b"a", b"bc")


def test_error_is_a_value_error() -> None:
    assert issubclass(EntryFormatError, ValueError)


def test_metadata_is_typed_and_keeps_unknown_fields() -> None:
    entry = Entry(KEY, (b"x",), {"devices": [{"device_name": "d"}], "kind": "binary",
                                 "compile_seconds": 2.5, "from_a_newer_writer": {"a": 1}})
    back = decode(encode(entry))
    assert back.meta.compile_seconds == 2.5 and back.meta.kind == "binary"
    assert back.meta.devices == [{"device_name": "d"}] and back.meta.files is None
    assert back.meta.extra == {"from_a_newer_writer": {"a": 1}}
    assert encode(back) == encode(entry)
    with pytest.raises(EntryFormatError, match="'created' is str"):
        Entry(KEY, (b"x",), {"devices": [], "created": "yesterday"})


# Issue 18: one rule for every reader (load, verify, import, list) and every writer.
@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("created", float("nan")),
        ("created", float("inf")),
        ("created", float("-inf")),
        ("created", 1e300),
        ("created", -1.0),
        ("created", 253402300800.0),  # a second after 9999-12-31 23:59:59 UTC
        ("created", 10**400),  # a JSON integer: no float holds it
        ("created", True),
        ("compile_seconds", float("nan")),
        ("compile_seconds", -0.5),
        ("compile_seconds", 1e12),
        ("compile_seconds", False),
    ],
)
def test_implausible_numbers_are_format_errors(name: str, value: object) -> None:
    data = _sealed_with_meta({"key": KEY, "binary_sizes": [3], name: value})
    with pytest.raises(EntryFormatError, match=f"bad metadata: '{name}'"):
        decode(data)
    with pytest.raises(EntryFormatError, match=f"bad metadata: '{name}'"):
        read_meta(io.BytesIO(data))
    with pytest.raises(EntryFormatError, match=f"bad metadata: '{name}'"):  # nor can a writer make one
        EntryMeta(**{name: value})  # type: ignore[arg-type]


def test_plausible_numbers_at_the_edges_decode() -> None:
    for created, seconds in ((0, 0), (253402300799.0, 365 * 86400.0), (1_700_000_000, 12)):
        entry = decode(_sealed_with_meta({"key": KEY, "binary_sizes": [3], "created": created,
                                          "compile_seconds": seconds}))
        assert (entry.meta.created, entry.meta.compile_seconds) == (created, seconds)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"key": "k", "binary_sizes": [3], "created": ' + b"1" * 5000 + b"}",  # int digit limit
        b"[" * 100_000 + b"]" * 100_000,  # nesting deeper than the recursion limit
    ],
    ids=["huge-integer", "deep-nesting"],
)
def test_json_that_python_will_not_parse_is_a_format_error(raw: bytes) -> None:
    data = _sealed_with_meta(None, raw=raw)
    with pytest.raises(EntryFormatError, match="bad metadata"):
        decode(data)
    with pytest.raises(EntryFormatError, match="bad metadata"):
        read_meta(io.BytesIO(data))
