"""``asyncclcache export`` and ``import``: a cache directory as one tar archive.

For CI images, containers and moving a warm cache to another cluster. The archive is
a plain tar (``tarfile``; compression by the file's suffix: ``.tar``, ``.tar.gz`` or
``.tgz``, ``.tar.xz``, ``.tar.bz2``) of entry files under their names in the cache::

    v1/[rank-<N>/]<key[:2]>/<key>.acl

Export writes only entries that pass the full check (format, checksum, key, paths)
and publishes the archive atomically. Import reads the archive twice and writes
nothing until every member has passed the same checks: a member that is a link, a
device, an absolute path, ``..``, any name outside the layout, or a damaged entry
refuses the whole archive. Then each entry is merged under its per-key lock: kept
where the directory's copy is at least as new (``created``) and sound, else written
atomically. An archive is native code that pocl will load: import only archives
you trust; the checks prove integrity and format, not who made it.

Both are safe while other processes use the directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import lzma
import os
import re
import tarfile
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from io import BytesIO
from pathlib import Path

from .entry import EntryFormatError
from .errors import ArchiveError
from .fileio import TEMP_PREFIX, atomic_writer
from .keys import FORMAT_VERSION
from .locks import LOCK_SUFFIX
from .shared import (
    BAKED_MARK,
    ENTRY_SUFFIX,
    PRUNE_LOCK,
    RANK_PREFIX,
    STATS_DIR,
    STATS_FILE,
    STATS_LOCK,
    UPKEEP_FILE,
    check_data,
    version_dir,
)
from .store import PublishResult, Store

__all__ = ["ArchiveError", "ExportResult", "ImportResult", "export_archive", "import_archive"]

#: Largest entry accepted from an archive (a kcache entry is a few MB).
MAX_MEMBER = 1 << 30
# The directory's names (shared.py spells them): members are named like its files.
_V, _RANK, _SUFFIX = re.escape(version_dir(Path()).name), re.escape(RANK_PREFIX), re.escape(ENTRY_SUFFIX)
_ENTRY_RE = re.compile(rf"^{_V}/(?:{_RANK}(\d{{1,9}})/)?([0-9a-f]{{2}})/([0-9a-f]{{64}}){_SUFFIX}$")
# Directories of the layout, and files a hand-made tar of a cache directory also holds
# (locks, lifetime counters, temp files): ignored, never written.
_STATS = re.escape(STATS_DIR)
_DIR_RE = re.compile(rf"^(?:{_V}(?:/{_RANK}\d{{1,9}})?(?:/[0-9a-f]{{2}}|/{_STATS})?)?$")
_NAMES = "|".join(re.escape(n) for n in (STATS_FILE, STATS_LOCK, PRUNE_LOCK, UPKEEP_FILE, BAKED_MARK))
_IGNORED_RE = re.compile(
    rf"^{_V}/(?:{_RANK}\d{{1,9}}/)?(?:{_NAMES}|{_STATS}/[^/]*"
    rf"|[0-9a-f]{{2}}/[0-9a-f]{{64}}{re.escape(LOCK_SUFFIX)}|[0-9a-f]{{2}}/{re.escape(TEMP_PREFIX)}[^/]*)$"
)
_MODES = {".tar": "", ".tar.gz": "gz", ".tgz": "gz", ".tar.xz": "xz", ".txz": "xz", ".tar.bz2": "bz2",
          ".tbz2": "bz2"}


@dataclass
class ExportResult:
    """What :func:`export_archive` wrote."""

    entries: int = 0
    bytes: int = 0
    damaged: list[str] = field(default_factory=list)  # entries left out: they failed the check


@dataclass
class ImportResult:
    """What :func:`import_archive` did, per entry."""

    added: int = 0
    replaced: int = 0
    kept: int = 0  # the directory's copy is as new or newer
    busy: int = 0  # another process was writing that key: left to it
    ignored: int = 0  # lock, temp and counter files of a hand-made archive
    unsafe: list[str] = field(default_factory=list)  # a link or foreign file in the way: untouched

    @property
    def imported(self) -> int:
        return self.added + self.replaced + self.kept + self.busy + len(self.unsafe)


def compression(path: str | os.PathLike[str]) -> str:
    """tarfile's compression for ``path``'s suffix; ``ArchiveError`` if unknown."""
    name = os.fspath(path).lower()
    for suffix in sorted(_MODES, key=len, reverse=True):
        if name.endswith(suffix):
            return _MODES[suffix]
    raise ArchiveError(f"{path}: unknown archive type; use .tar, .tar.gz, .tgz, .tar.xz or .tar.bz2")


# {{{ export

def export_archive(
    stores: Sequence[Store], out: str | os.PathLike[str], *, device: str | None = None
) -> ExportResult:
    """Pack the entries of ``stores`` (all under one base directory) into ``out``.

    ``device``: only entries for a device whose name contains it (case-insensitive).
    The archive appears atomically (temp file + rename); nothing is left on error.
    """
    mode = compression(out)
    out = Path(out)
    result = ExportResult()
    with atomic_writer(out.parent, out, prefix=f".{out.name}.") as f, tarfile.open(  # type: ignore[call-overload]
        fileobj=f, mode=f"w:{mode}" if mode else "w", format=tarfile.PAX_FORMAT
    ) as tar:
        for store in stores:
            for name, data, mtime in _entries(store, device, result):
                info = tarfile.TarInfo(name)
                info.size, info.mode, info.mtime = len(data), 0o600, int(mtime)
                tar.addfile(info, BytesIO(data))
                result.entries += 1
                result.bytes += len(data)
    return result


def _entries(store: Store, device: str | None, result: ExportResult) -> Iterator[tuple[str, bytes, float]]:
    prefix = store.root.relative_to(store.base).as_posix()
    for e in sorted(store.entries(), key=lambda e: e.key):
        r = store.read(e.key)
        if r.entry is None or r.data is None:
            if r.problem is not None:
                result.damaged.append(f"{e.path}: {r.problem}")
            continue
        if device is not None and not r.entry.meta.for_device(device):
            continue
        yield f"{prefix}/{e.key[:2]}/{e.key}{ENTRY_SUFFIX}", r.data, e.mtime

# }}}


# {{{ import

@dataclass(frozen=True)
class _Member:
    name: str
    rank: int | None
    key: str
    digest: bytes
    created: float


def import_archive(base: str | os.PathLike[str], archive: str | os.PathLike[str]) -> ImportResult:
    """Merge ``archive`` into the cache directory ``base`` (created if missing).

    Raises :class:`ArchiveError` (having written nothing) if any member fails a check,
    ``OSError`` for I/O problems of the directory. Process-safe.
    """
    members, ignored = _check_archive(archive)
    result = ImportResult(ignored=ignored)
    stores: dict[int | None, Store] = {}
    by_name = {m.name: m for m in members}
    with _open(archive) as tar:
        for info in tar:
            m = by_name.get(_normal(info.name))
            if m is None or not info.isreg():
                continue
            data = _read(tar, info)
            if hashlib.blake2b(data).digest() != m.digest:
                raise ArchiveError(f"{info.name}: changed while it was imported; stopped "
                                   f"after {result.imported} entries")
            store = stores.get(m.rank)
            if store is None:
                store = stores[m.rank] = _target(base, m.rank)
            _merge(store, m, data, result)
    return result


def _target(base: str | os.PathLike[str], rank: int | None) -> Store:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # said below, as an error
        # No node copies: an import reads nothing back (inside a Slurm step it would copy
        # every entry into the node's storage).
        store = Store(base, rank_local=rank is not None, rank=rank, node_copies=False)
    if not store.writable:
        raise ArchiveError(f"cannot write to {store.root}: {store.problem or 'read-only'}")
    return store


def _merge(store: Store, m: _Member, data: bytes, result: ImportResult) -> None:
    claim = store.claim(m.key)
    if claim is None:
        result.busy += 1
        return
    try:
        present = store.read(m.key)
        if present.entry is not None and present.entry.meta.created >= m.created:
            result.kept += 1
            return
        if present.insecure:
            result.unsafe.append(f"{store.path_for(m.key)}: {present.problem}")
            return
        written = store.publish_encoded(m.key, data, claim=claim)
        if written is PublishResult.WRITTEN:
            if present.entry is not None or present.problem is not None:
                result.replaced += 1
            else:
                result.added += 1
        else:
            result.busy += 1
    finally:
        claim.release()


def _check_archive(archive: str | os.PathLike[str]) -> tuple[list[_Member], int]:
    """Every member checked, nothing written. ``ArchiveError`` names the first bad one."""
    members: list[_Member] = []
    seen: set[str] = set()
    ignored = 0
    with _open(archive) as tar:
        for info in tar:
            name = _normal(info.name)
            where = f"{archive}: member {info.name!r}"
            if info.name.startswith("/") or (len(info.name) > 1 and info.name[1] == ":"):
                raise ArchiveError(f"{where}: absolute path")
            if ".." in info.name.replace("\\", "/").split("/"):
                raise ArchiveError(f"{where}: '..' in the path")
            if info.issym() or info.islnk():
                raise ArchiveError(f"{where}: a link (to {info.linkname!r})")
            if info.isdir():
                if not _DIR_RE.match(name):
                    raise ArchiveError(f"{where}: not a directory of a cache (v{FORMAT_VERSION}/...)")
                continue
            if not info.isreg():
                raise ArchiveError(f"{where}: not a regular file")
            if _IGNORED_RE.match(name):
                ignored += 1
                continue
            match = _ENTRY_RE.match(name)
            if match is None:
                raise ArchiveError(f"{where}: not an entry of a v{FORMAT_VERSION} cache "
                                   f"(v{FORMAT_VERSION}/[rank-N/]<key[:2]>/<key>.acl)")
            rank, fanout, key = match.group(1), match.group(2), match.group(3)
            if key[:2] != fanout:
                raise ArchiveError(f"{where}: in the wrong directory for its key")
            if name in seen:
                raise ArchiveError(f"{where}: appears twice")
            seen.add(name)
            data = _read(tar, info)
            try:
                entry = check_data(key, data)
            except EntryFormatError as e:
                raise ArchiveError(f"{where}: damaged entry: {e}") from None
            members.append(_Member(name, None if rank is None else int(rank), key,
                                   hashlib.blake2b(data).digest(), float(entry.meta.created)))
    return members, ignored


def _normal(name: str) -> str:
    # `tar -C dir -cf x.tar .` names members ./v1/...
    while name.startswith("./"):
        name = name[2:]
    return name.rstrip("/") if name not in (".", "./") else ""


@contextlib.contextmanager
def _open(archive: str | os.PathLike[str]) -> Iterator[tarfile.TarFile]:
    try:
        tar = tarfile.open(archive, mode="r:*")  # noqa: SIM115 - closed below, errors told apart
    except FileNotFoundError:
        raise ArchiveError(f"{archive}: no such file") from None
    except (tarfile.TarError, EOFError, OSError) as e:
        raise ArchiveError(f"{archive}: not a readable tar archive ({e})") from None
    try:
        yield tar
    except (tarfile.TarError, EOFError, OSError, ValueError, zlib.error, lzma.LZMAError) as e:
        if isinstance(e, OSError) and e.errno is not None:
            raise  # the directory's I/O, not the archive's content
        raise ArchiveError(f"{archive}: damaged archive ({e or type(e).__name__})") from None
    finally:
        tar.close()


def _read(tar: tarfile.TarFile, info: tarfile.TarInfo) -> bytes:
    if info.size > MAX_MEMBER:
        raise ArchiveError(f"member {info.name!r}: {info.size} bytes, more than an entry may have")
    with tar.extractfile(info) or BytesIO() as f:
        data = f.read()
    if len(data) != info.size:
        raise ArchiveError(f"member {info.name!r}: truncated")
    return data

# }}}
