"""Fuzzing (hypothesis): the entry decoder and the store's reader turn any bytes into a
result or their own error, never another exception."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import struct
import warnings
from pathlib import Path
from typing import Any

import pytest

from conftest import need

try:
    import hypothesis  # noqa: F401 - the test extra brings it
except ImportError:
    need("hypothesis", "hypothesis is not installed (pip install '.[test]')")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncclcache import maintenance
from asyncclcache.entry import MAGIC, Entry, EntryFormatError, decode, encode, read_meta
from asyncclcache.errors import AsyncCLCacheWarning
from asyncclcache.keys import FORMAT_VERSION
from asyncclcache.store import Store

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=10,
)
FIELDS = ["kind", "devices", "files", "kernels", "build_logs", "options", "includes", "created",
          "compile_seconds", "binary_sizes", "key", "snapshot"]


def _with_checksum(meta: dict[str, Any], blobs: list[bytes]) -> bytes:
    # A well-formed container around arbitrary metadata: only the content is hostile.
    meta_bytes = json.dumps(meta).encode()
    body = b"".join([struct.pack("<8sHHI", MAGIC, FORMAT_VERSION, 0, len(meta_bytes)), meta_bytes, *blobs])
    return body + hashlib.blake2b(body, digest_size=32).digest()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_decoder_on_any_bytes(data: bytes) -> None:
    with contextlib.suppress(EntryFormatError):  # its own error, nothing else
        decode(data)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6), st.lists(st.binary(max_size=8), max_size=3))
def test_decoder_on_checksummed_hostile_metadata(meta: dict[str, Any], blobs: list[bytes]) -> None:
    meta = dict(meta, key="k" * 64)
    meta.setdefault("binary_sizes", [len(b) for b in blobs])
    try:
        entry = decode(_with_checksum(meta, blobs))
    except EntryFormatError:
        return
    # What decodes has the types its readers rely on.
    assert isinstance(entry.kind, str)
    for name in ("kernels", "files", "build_logs"):
        assert all(isinstance(x, str) for x in entry.meta.get(name, []))
    try:
        read_meta(io.BytesIO(_with_checksum(meta, blobs)))
    except EntryFormatError:
        pytest.fail("read_meta refused what decode accepted")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6))
def test_store_load_never_raises_for_content(tmp_path: Path, meta: dict[str, Any]) -> None:
    store = Store(tmp_path / "acc")
    key = hashlib.sha256(json.dumps(meta, sort_keys=True, default=str).encode()).hexdigest()
    meta = dict(meta, key=key)
    blobs = [b"x"]
    meta["binary_sizes"] = [1]
    path = store.path_for(key)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.write_bytes(_with_checksum(meta, blobs))
    path.chmod(0o600)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AsyncCLCacheWarning)
        got = store.load(key)
        maintenance.verify(store)
    assert got is None or isinstance(got, Entry)


def test_a_valid_entry_still_loads(tmp_path: Path) -> None:
    store = Store(tmp_path / "acc")
    e = Entry("a" * 64, (b"bin",), {"devices": [{"device_name": "d"}], "kernels": ["k"], "created": 1.0})
    store.publish(e)
    assert store.load(e.key) == decode(encode(e))
