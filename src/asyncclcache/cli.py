"""The ``asyncclcache`` command (also ``python -m asyncclcache``).

Commands: ``info``, ``list``, ``verify``, ``prune``, ``clear``, ``stats``, ``export``,
``import``, ``bake`` (:mod:`.bake`); ``run`` (:mod:`.runner`) and ``bench``. Every maintenance command takes
``--dir`` and ``--json``. Human output fits the terminal's width (``COLUMNS``, else 80): long
lines are wrapped between words, long kernel lists in ``list`` end in an ellipsis; the JSON
keys are stable. Only
``import`` creates a cache directory.

Exit codes: 0 success; 1 ``verify`` found bad entries, or ``import`` refused an archive;
2 usage error, or a cache directory that is foreign or unusable (a missing one is an
empty cache), or not writable where the command changes it. ``run`` exits with the
program's status.

Names read from the directory (keys, devices, kernels, paths) are printed with control
characters escaped, so an entry cannot send escape sequences to the terminal.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._version import __version__
from .errors import UsageError

__all__ = ["main"]

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2
WIDTH = 80  # without a terminal or COLUMNS
MIN_WIDTH = 40  # narrower terminals wrap what they get themselves
_AGE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_AGE_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def _human(n: float) -> str:
    for unit in ("B", "K", "M", "G", "T"):
        if abs(n) < 1024 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n}"


def _when(t: float | None) -> str:
    if not t:
        return "-"
    try:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))
    except (OverflowError, OSError, ValueError):  # a file time set to year 10**9, say
        return "?"


def _printable(text: str) -> str:
    """``text`` with control and other unprintable characters (and undecodable bytes of
    file names) escaped as ``repr`` does: names from the disk reach a terminal."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _width() -> int:
    """The terminal's columns (``COLUMNS`` first, as :func:`shutil.get_terminal_size` reads it)."""
    return max(MIN_WIDTH, shutil.get_terminal_size((WIDTH, 24)).columns)


def _ellipsis() -> str:
    """One column where stdout can encode it (a C locale without UTF-8 may not)."""
    try:
        "\u2026".encode(sys.stdout.encoding or "ascii")
    except (UnicodeEncodeError, LookupError):
        return "..."
    return "\u2026"


_LABEL_RE = re.compile(r"^(\s*\S.*?\s{2,})\S")


def _fit(line: str, width: int) -> list[str]:
    """``line`` wrapped between words to ``width``; continuation lines start under the value
    after a label (text, then two spaces or more), else two columns in. A single word wider
    than that (a long path) is kept whole on a line of its own: cut, it would be wrong."""
    if len(line) <= width:
        return [line]
    label = _LABEL_RE.match(line)
    if label and len(label.group(1)) <= width // 2:
        indent = len(label.group(1))
    else:
        indent = len(line) - len(line.lstrip()) + 2
    lines = textwrap.wrap(line, width, subsequent_indent=" " * indent, break_long_words=False,
                          break_on_hyphens=False) or [line]
    # A word too long for its indent moves left as far as it must, if that makes it fit.
    return [ln if len(ln) <= width or " " in ln.strip() else " " * max(0, width - len(ln.strip())) + ln.strip()
            for ln in lines]


def _shorten(names: list[str], room: int) -> str:
    """``names`` joined by commas, as many whole names as ``room`` takes, then an ellipsis
    and how many are left out: never a name cut."""
    full = ",".join(names)
    if len(full) <= room:
        return full
    dots = _ellipsis()
    shown: list[str] = []
    for i, name in enumerate(names):
        rest = f"{dots}(+{len(names) - i - 1})" if i + 1 < len(names) else ""
        if len(",".join([*shown, name])) + (1 + len(rest) if rest else 0) > room:
            break
        shown.append(name)
    left = len(names) - len(shown)
    return ",".join([*shown, f"{dots}(+{left})"]) if shown else f"{dots}(+{left})"


def parse_age(text: str) -> float:
    """``30d``, ``12h``, ``45m``, ``10s`` or plain seconds."""
    m = _AGE_RE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected an age like 30d, 12h, 45m or 10s, got {text!r}")
    return float(m.group(1)) * _AGE_UNIT[m.group(2)]


def _jobs_arg(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of processes, got {text!r}") from None
    if not 1 <= n <= 1024:
        raise argparse.ArgumentTypeError(f"expected 1 to 1024 processes, got {n}")
    return n


def _default_jobs() -> int:
    from .system import usable_cores

    return usable_cores()


def _size_arg(text: str) -> int:
    from .config import parse_size

    try:
        size = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return size or 0


# {{{ opening the directory

def _stores(args: argparse.Namespace) -> list[Any]:
    """The stores under the directory: the shared one and one per rank subdirectory.

    A missing (or empty) directory is an empty cache; a regular file, a directory of
    something else, or one that is not safe to load native code from is a usage error.
    """
    from .store import Store, ranks

    base = _base(args)
    if not _check_base(base).is_dir():
        return []
    stores = [Store(base, rank_local=False, create=False)]
    stores += [Store(base, rank_local=True, rank=rank, create=False) for rank in ranks(base)]
    for s in stores:
        if not s.enabled:
            raise UsageError(f"cannot use cache directory {s.root}: {s.problem}")
    return stores


def _check_base(base: Path) -> Path:
    """``base/v<N>``; a usage error if ``base`` exists and is not a cache directory we may use."""
    from .fileio import insecure
    from .keys import FORMAT_VERSION
    from .store import version_dir as version_dir_of

    version_dir = version_dir_of(base)
    if base.exists():
        if not base.is_dir():
            raise UsageError(f"cannot use cache directory {base}: not a directory")
        why = insecure(base.stat())
        if why is not None:
            raise UsageError(f"cannot use cache directory {base}: it is {why}")
        if not version_dir.is_dir() and any(base.iterdir()):
            raise UsageError(f"{base} is not an asyncclcache cache (no v{FORMAT_VERSION}/ inside)")
    return version_dir


def _base(args: argparse.Namespace) -> Path:
    from .config import absolute_path, get_config
    from .store import default_directory

    try:
        return Path(absolute_path(args.dir, "--dir") if args.dir else get_config().directory
                    or default_directory())
    except ValueError as e:
        raise UsageError(str(e)) from None


def _listing(stores: list[Any], device: str | None = None) -> list[dict[str, Any]]:
    from .entry import EntryMeta

    rows = []
    for s in stores:
        for e in s.entries():
            # None: metadata that EntryMeta refuses (as verify and import do), or unreadable.
            read = s.read_meta(e.path)
            meta = read or EntryMeta()
            if device and not meta.for_device(device):
                continue
            devices = [d.get("device_name", "?") for d in meta.devices]
            rows.append({
                "key": e.key,
                "kind": ("baked" if meta.baked_from else meta.kind) if read is not None else None,
                "baked_from": meta.baked_from,
                "kernels": meta.kernels,
                "devices": devices,
                "size": e.size,
                "created": meta.created or None,
                "last_used": max(e.atime, e.mtime),
                "rank": s.rank if s.rank_local else None,
                "path": str(e.path),
                "damaged": read is None,
            })
    rows.sort(key=lambda r: r["last_used"], reverse=True)
    return rows


def _emit(args: argparse.Namespace, data: Any, human: list[str]) -> None:
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))  # escapes control characters itself
    else:
        width = _width()
        for line in human:
            for part in _fit(_printable(line).rstrip(), width):
                print(part)


def _check_writable(stores: list[Any], doing: str) -> None:
    """A clear error, before anything is changed, where a directory that ``doing`` writes
    (each root and fan-out directory: entries are unlinked there) is not writable."""
    effective = os.access in os.supports_effective_ids
    for s in stores:
        for d in [s.root, *s.fanout_dirs()]:
            if os.access(d, os.W_OK | os.X_OK, effective_ids=effective):
                continue
            try:
                read_only_fs = bool(os.statvfs(d).f_flag & os.ST_RDONLY)
            except OSError:
                read_only_fs = False
            why = "read-only file system" if read_only_fs else "permission denied"
            raise UsageError(f"cannot {doing} {d}: the directory is not writable ({why})")

# }}}


def _opencl_versions(strategy: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:
        import pyopencl as cl

        from .config import strategy_in_use
        from .drivers import auto_reason, resolve_strategy

        out["pyopencl"] = cl.VERSION_TEXT
        out["platforms"] = []
        for p in cl.get_platforms():
            try:
                devices = p.get_devices()
            except cl.Error:
                devices = []  # a platform without devices (Clover, rusticl not enabled)
            row: dict[str, Any] = {"name": p.name, "version": p.version, "devices": [d.name for d in devices]}
            if devices:
                # What a build for this platform's devices uses, and why (auto's choice).
                row["strategy"] = resolve_strategy(strategy_in_use(strategy), devices)
                row["reason"] = auto_reason(devices)
            out["platforms"].append(row)
    except Exception as e:  # noqa: BLE001 - info must work without a driver
        out["opencl_error"] = f"{type(e).__name__}: {e}"
    return out


def _lifetime(stores: list[Any]) -> dict[str, float]:
    from .stats import LIFETIME_FIELDS, read_lifetime

    total: dict[str, float] = dict.fromkeys(LIFETIME_FIELDS, 0)
    for s in stores:
        for k, v in read_lifetime(s.root).items():
            total[k] += v
    return total


def _node_copies(cfg: Any) -> dict[str, Any]:
    """Where ranks keep node-local copies of entries (docs/mpi.md), and when."""
    from .nodecopies import node_base

    base = node_base(cfg.node_dir, cfg.test_node).base
    when = {None: "for ranks", True: "always", False: "off"}[cfg.node_copies]  # shown first: lines are cut
    return {"when": when, "directory": str(base), "max_size": cfg.node_max_size}


def cmd_info(args: argparse.Namespace) -> int:
    from .config import get_config
    from .keys import FORMAT_VERSION
    from .store import version_dir

    stores = _stores(args)
    rows = _listing(stores)
    cfg = get_config()
    devices: dict[str, int] = {}
    for r in rows:
        for d in r["devices"]:
            devices[d] = devices.get(d, 0) + 1
    life = _lifetime(stores)
    info: dict[str, Any] = {
        "directory": str(version_dir(_base(args))),
        "exists": bool(stores),
        "rank_directories": [str(s.root) for s in stores if s.rank_local],
        "format_version": FORMAT_VERSION,
        "entries": len(rows),
        "baked": sum(r["kind"] == "baked" for r in rows),
        "kcache_entries": sum(r["kind"] == "kcache" for r in rows),
        "bytes": sum(r["size"] for r in rows),
        "max_size": cfg.max_size,
        "strategy": cfg.strategy,
        "asyncclcache": __version__,
        "devices_seen": devices,
        "lifetime": life,
    }
    info["node_copies"] = _node_copies(cfg)
    info.update(_opencl_versions(cfg.strategy))
    human = [
        f"asyncclcache {__version__}",
        f"  directory      {info['directory']}" + ("" if stores else "  (not created yet)"),
    ]
    if info["rank_directories"]:
        human.append(f"  rank-local     {len(info['rank_directories'])} rank directories")
    human.append(f"  node copies    {info['node_copies']['when']}: {info['node_copies']['directory']}")
    human += [
        f"  format         v{FORMAT_VERSION}",
        f"  entries        {info['entries']}  ({_human(info['bytes'])})",
        f"  baked          {info['baked']} of {info['kcache_entries']} kernel-cache entries"
        + ("" if info["baked"] >= info["kcache_entries"] else "  (asyncclcache bake makes the rest)"),
        f"  max size       {_human(cfg.max_size) if cfg.max_size else 'unlimited'}",
        f"  strategy       {cfg.strategy}",
    ]
    for name, n in sorted(devices.items()):
        human.append(f"  device seen    {name} ({n} entries)")
    if "pyopencl" in info:
        human.append(f"  pyopencl       {info['pyopencl']}")
    for p in info.get("platforms", []):
        human.append(f"  platform       {p['name']}: {p['version']}")
        if "strategy" in p:
            human.append(f"    uses         {p['strategy']}: {p['reason']}")
    if "opencl_error" in info:
        human.append(f"  OpenCL         unavailable: {info['opencl_error']}")
    human.append(
        f"  lifetime       {life['hits']:.0f} hits, {life['misses']:.0f} misses, "
        f"{life['writes']:.0f} writes, {life['baked_hits']:.0f} baked hits, {life['errors']:.0f} errors, "
        f"{life['seconds_saved']:.1f} s saved"
    )
    _emit(args, info, human)
    return EXIT_OK


def _kernels_at_devices(kernels: list[str], devices: list[str], room: int) -> str:
    """``kernels @ devices`` in ``room`` columns where it can: whole kernel names, then an
    ellipsis and the count left out; a long device name cut after a word (inside its first
    word only where that alone is too long), with an ellipsis.
    The kernels come first: the device name gets what they leave, down to a third."""
    kernels = [_printable(k) for k in kernels] or ["?"]
    dev = ",".join(_printable(d) for d in devices)
    if len(",".join(kernels)) + 3 + len(dev) <= room:
        return f"{','.join(kernels)} @ {dev}"
    for dev_room in (len(dev), (room - 3) // 2, (room - 3) // 3):
        kern = _shorten(kernels, room - 3 - min(dev_room, len(dev)))
        if not kern.startswith(_ellipsis()):
            break
    left = max(room - 3 - len(kern), 1)
    if len(dev) > left:
        dots = _ellipsis()
        cut = textwrap.shorten(dev, left, placeholder=dots)
        # A first word longer than the room: its start, marked cut, beats an ellipsis alone.
        dev = cut if cut != dots else dev[:max(left - len(dots), 1)] + dots
    return f"{kern} @ {dev}"


def cmd_list(args: argparse.Namespace) -> int:
    rows = _listing(_stores(args), args.device)
    width = _width()
    # Key, kind, size, last used: 45 columns. CREATED where the kernels still get 30 more;
    # kernels @ device on a line of their own where they would get fewer than 20.
    created = width - 62 >= 30
    fixed = 62 if created else 45
    below = width - fixed < 20
    room = width - 4 if below else width - fixed
    head = (f"{'KEY':12s} {'KIND':6s} {'SIZE':>7s} " + (f"{'CREATED':16s} " if created else "")
            + f"{'LAST USED':16s}")
    human = [head, "    KERNELS @ DEVICE"] if below else [f"{head} KERNELS @ DEVICE"]
    for r in rows:
        if r["damaged"]:
            what = "damaged: see asyncclcache verify"
        else:
            what = _kernels_at_devices(r["kernels"], r["devices"], room)
        row = (f"{r['key'][:12]} {(r['kind'] or 'bad')[:6]:6s} {_human(r['size']):>7s} "
               + (f"{_when(r['created']):16s} " if created else "") + f"{_when(r['last_used']):16s}")
        if not below and what.startswith(_ellipsis()):  # not one kernel name fits: a line of their own
            human += [row, f"    {_kernels_at_devices(r['kernels'], r['devices'], width - 4)}"]
        else:
            human += [row, f"    {what}"] if below else [f"{row} {what}"]
    human.append(f"{len(rows)} entries, {_human(sum(r['size'] for r in rows))}")
    damaged = sum(r["damaged"] for r in rows)
    if damaged:
        human.append(f"{damaged} damaged (asyncclcache verify --fix removes them)")
    _emit(args, {"entries": rows}, human)
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    from . import maintenance
    stores = _stores(args)
    if args.fix:
        _check_writable(stores, "fix")
    checked = 0
    bad: list[dict[str, str]] = []
    temps: list[str] = []
    locks: list[str] = []
    for s in stores:
        checked += sum(1 for _ in s.entries())
        for e, problem in maintenance.verify(s, fix=args.fix):
            bad.append({"key": e.key, "path": str(e.path), "problem": problem})
        t, lk = maintenance.orphans(s)
        temps += [str(p) for p in t]
        locks += [str(p) for p in lk]
        if args.fix:
            maintenance.sweep(s)
    human = [f"checked {checked} entries: {len(bad)} bad" + (" (removed)" if args.fix and bad else "")]
    human += [f"  bad  {b['key'][:12]}  {b['problem']}" for b in bad]
    if temps or locks:
        verb = "removed" if args.fix else "found"
        human.append(f"{verb} {len(temps)} orphaned temp files, {len(locks)} orphaned lock files "
                     f"(under {_base(args)})")
        base = str(_base(args)) + os.sep
        human += [f"  orphan  {p.removeprefix(base)}" for p in temps + locks]  # the name: in view
    _emit(args, {"checked": checked, "bad": bad, "fixed": bool(args.fix),
                 "orphaned_temp_files": temps, "orphaned_lock_files": locks}, human)
    return EXIT_CHECK_FAILED if bad else EXIT_OK


def cmd_prune(args: argparse.Namespace) -> int:
    from . import maintenance
    from .config import get_config

    max_size = args.max_size if args.max_size is not None else get_config().max_size
    max_size = max_size or None  # 0: no bound, as ASYNCCLCACHE_MAX_SIZE=0
    if max_size is None and args.older_than is None:
        raise UsageError("prune needs --max-size or --older-than (or ASYNCCLCACHE_MAX_SIZE); "
                         "a size of 0 means no bound")
    stores = _stores(args)
    _check_writable(stores, "prune")
    removed = freed = remaining = 0
    busy = False
    for s in stores:
        # The bound applies to each directory that a process fills (each rank's, say). The
        # whole upkeep: its processes then leave the directory alone for an interval.
        r = maintenance.upkeep(s, max_size=max_size, older_than=args.older_than)
        busy = busy or not r.ran
        removed += r.removed
        freed += r.freed
        remaining += r.remaining if r.ran else s.total_bytes()
    human = [f"removed {removed} entries ({_human(freed)}); {_human(remaining)} remain"]
    if busy:
        human.append("another process was pruning part of the cache: skipped it")
    _emit(args, {"removed": removed, "freed": freed, "remaining": remaining, "busy": busy}, human)
    return EXIT_OK


def cmd_clear(args: argparse.Namespace) -> int:
    from . import maintenance
    stores = _stores(args)
    _check_writable(stores, "clear")
    if not args.yes:
        if not sys.stdin.isatty():
            raise UsageError("clear removes every entry: pass --yes")
        answer = input(f"remove every entry under {_base(args)}? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing removed")
            return EXIT_OK
    removed = sum(maintenance.clear(s) for s in stores)
    _emit(args, {"removed": removed}, [f"removed {removed} entries"])
    return EXIT_OK


def cmd_stats(args: argparse.Namespace) -> int:
    from .stats import COUNTERS, reset_lifetime

    stores = _stores(args)
    if args.reset:
        for s in stores:
            reset_lifetime(s.root)
    life = _lifetime(stores)
    human = [f"lifetime stats of {_base(args)}" + (" (reset)" if args.reset else "")]
    for c in COUNTERS:
        if c.lifetime:
            v = life[c.name]
            shown = f"{v:.1f} s" if c.unit == "s" else (_human(v) if c.unit == "bytes" else f"{v:.0f}")
            human.append(f"  {c.name:16s} {shown}")
    _emit(args, life, human)
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    from .archive import ArchiveError, export_archive

    stores = _stores(args)
    if args.rank is not None:
        stores = [s for s in stores if s.rank_local and s.rank == args.rank]
        if not stores:
            raise UsageError(f"no directory for rank {args.rank} under {_base(args)}")
    elif args.shared:
        stores = [s for s in stores if not s.rank_local]
    baked: tuple[dict[str, Any], list[str]] | None = None
    if args.bake:
        baked = _bake_report(_bake(args, stores))
    try:
        r = export_archive(stores, args.file, device=args.device)
    except ArchiveError as e:
        raise UsageError(str(e)) from None
    human = [*(baked[1] if baked else []), f"exported {r.entries} entries ({_human(r.bytes)}) to {args.file}"]
    if r.damaged:
        human.append(f"left out {len(r.damaged)} damaged entries (asyncclcache verify --fix removes them)")
        human += [f"  damaged  {d}" for d in r.damaged]
    data = {"file": str(args.file), "entries": r.entries, "bytes": r.bytes, "damaged": r.damaged}
    if baked:
        data["bake"] = baked[0]
    _emit(args, data, human)
    return EXIT_OK


def cmd_bake(args: argparse.Namespace) -> int:
    # Entries left unbaked (no OpenCL platform here, say) are counted with the reason, not an error.
    _emit(args, *_bake_report(_bake(args, _stores(args))))
    return EXIT_OK


def _bake_report(result: Any) -> tuple[dict[str, Any], list[str]]:
    """The JSON and the lines of a bake's :class:`~.bake.BakeResult`."""
    data = {"baked": result.baked, "skipped": result.skipped, "failed": result.failed,
            "seconds": round(result.seconds, 3)}
    human = [f"asyncclcache bake: {result.line()}"]
    for what, reasons in (("skipped", result.skipped), ("failed ", result.failed)):
        for why, n in sorted(reasons.items()):
            # Wrapped, not cut: the end of a reason is often the point.
            lines = textwrap.wrap(_printable(why), _width() - 16, break_long_words=False,
                                  break_on_hyphens=False) or [""]
            human += [f"  {what} {n:4d}  {lines[0]}", *(f"{'':16s}{line}" for line in lines[1:])]
    return data, human


def _bake(args: argparse.Namespace, stores: list[Any]) -> Any:
    """Bake ``stores`` with a progress line on a terminal; Ctrl-C stops it (entries whole)."""
    from .bake import bake

    _check_writable(stores, "bake")
    tty = sys.stderr.isatty() and not args.json
    t0 = time.monotonic()

    def progress(result: Any, total: int) -> None:
        if not tty:
            return
        done = result.done
        elapsed = time.monotonic() - t0
        left = elapsed / max(1, result.baked + sum(result.failed.values())) * (total - done)
        sys.stderr.write(f"\rbaking: {done}/{total} entries, about {left:.0f} s left   ")
        sys.stderr.flush()

    try:
        result = bake(stores, jobs=args.jobs, device=args.device, progress=progress)
    except KeyboardInterrupt:
        if tty:
            sys.stderr.write("\n")
        print("asyncclcache bake: interrupted; every entry is whole", file=sys.stderr)
        raise
    if tty:
        sys.stderr.write("\r" + " " * 60 + "\r")
    return result


def cmd_import(args: argparse.Namespace) -> int:
    from .archive import ArchiveError, import_archive

    _check_base(_base(args))
    try:
        r = import_archive(_base(args), args.file)
    except ArchiveError as e:
        print(f"asyncclcache: refusing {_printable(str(e))}; nothing was imported", file=sys.stderr)
        return EXIT_CHECK_FAILED
    human = [f"imported {r.imported} entries ({r.added} added, {r.replaced} replaced, {r.kept} kept)"]
    if r.busy:
        human.append(f"skipped {r.busy} that another process was writing")
    if r.ignored:
        human.append(f"ignored {r.ignored} lock, temp and counter files")
    human += [f"  not replaced (unsafe)  {u}" for u in r.unsafe]
    _emit(args, {"file": str(args.file), "added": r.added, "replaced": r.replaced, "kept": r.kept,
                 "busy": r.busy, "ignored": r.ignored, "unsafe": r.unsafe}, human)
    return EXIT_OK


def cmd_bench(args: argparse.Namespace) -> int:
    return bench(args.bench_args)


def bench(argv: list[str]) -> int:
    """``asyncclcache bench ARGS``: ``python benchmarks/run.py ARGS`` of the checkout this
    package runs from; its exit status. The benchmarks are not installed with the package."""
    import subprocess

    run = Path(__file__).resolve().parents[2] / "benchmarks" / "run.py"
    if not run.is_file():
        raise UsageError(
            "bench needs a checkout: the benchmarks live in its benchmarks/ folder, which is not "
            "installed. Clone the repository, pip install -e . there, and run it from there"
        )
    try:
        return subprocess.call([sys.executable, str(run), *argv])
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and docs)."""
    parser = argparse.ArgumentParser(
        prog="asyncclcache",
        description="Run programs through the asyncclcache binary cache; inspect, maintain and ship it.",
        epilog="Exit codes: 0 ok, 1 verify found bad entries or import refused an archive, "
        "2 usage error or a foreign or unusable cache directory (a missing one is empty), "
        "or one that prune, clear or verify --fix cannot write; 130 interrupted; "
        "run: the program's.",
    )
    parser.add_argument("--version", action="version", version=f"asyncclcache {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="cache directory (default: $ASYNCCLCACHE_DIR or the user cache directory)",
    )
    common.add_argument("--json", action="store_true", help="machine-readable output (stable keys)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    device: tuple[tuple[str, ...], dict[str, Any]] = (
        ("--device",), {"help": "only entries for devices whose name contains this"})
    commands: list[tuple[str, Any, str, list[tuple[tuple[str, ...], dict[str, Any]]]]] = [
        ("info", cmd_info, "directory, entries, versions, limits, stats", []),
        ("list", cmd_list, "one line per entry", [device]),
        ("verify", cmd_verify, "check every entry; exit 1 if any is bad",
         [(("--fix",), {"action": "store_true", "help": "remove bad entries and orphaned files"})]),
        ("prune", cmd_prune, "evict least recently used entries",
         [(("--max-size",), {"type": _size_arg, "help": "keep at most this much, e.g. 500M"}),
          (("--older-than",), {"type": parse_age, "help": "evict entries unused this long, e.g. 30d"})]),
        ("clear", cmd_clear, "remove every entry", [(("--yes",), {"action": "store_true", "help": "do not ask"})]),
        ("stats", cmd_stats, "lifetime counters of the directory",
         [(("--reset",), {"action": "store_true", "help": "zero them"})]),
    ]
    for name, func, text, options in commands:
        p = sub.add_parser(name, parents=[common], help=text)
        for flags, kwargs in options:
            p.add_argument(*flags, **kwargs)
        p.set_defaults(func=func)
    p = sub.add_parser("export", parents=[common], help="pack the cache into one tar archive")
    p.add_argument("file", type=Path, help="archive to write: .tar, .tar.gz/.tgz, .tar.xz, .tar.bz2")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--rank", type=int, help="only this MPI rank's directory")
    which.add_argument("--shared", action="store_true", help="only the shared (not rank-local) directory")
    p.add_argument(*device[0], **device[1])
    p.add_argument("--bake", action="store_true", help="bake the kernel-cache entries first (see bake)")
    p.add_argument("--jobs", type=_jobs_arg, default=_default_jobs(), help="worker processes of --bake")
    p.set_defaults(func=cmd_export)
    p = sub.add_parser("bake", parents=[common],
                       help="make pocl kernel-cache entries into binaries that load at a binary's speed")
    p.add_argument("--jobs", type=_jobs_arg, default=_default_jobs(),
                   help="worker processes (default: the cores this process may use)")
    p.add_argument(*device[0], **device[1])
    p.set_defaults(func=cmd_bake)
    p = sub.add_parser("import", parents=[common],
                       help="merge an archive into the cache (checked first; exit 1 if refused)")
    p.add_argument("file", type=Path, help="archive made by export")
    p.set_defaults(func=cmd_import)
    p = sub.add_parser(
        "bench",
        add_help=False,
        help="run the benchmarks, write report.md/.json and plots "
        "([--quick] [--out DIR]; bench --help for more)",
    )
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_bench)
    # Parsed by runner.main (listed here for --help): options end where the program begins.
    sub.add_parser(
        "run", add_help=False,
        help="run a program with every pyopencl build cached: run [--dir D] [--strategy S] "
        "[--stats] script.py|-m MODULE|-- COMMAND [ARGS...]",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``asyncclcache`` command; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv[:1] == ["run"]:  # everything after the options is the program's own
        from . import runner

        return runner.main(argv[1:])
    if argv[:1] == ["bench"]:  # every option belongs to the benchmark's own parser
        try:
            return bench(argv[1:])
        except UsageError as e:
            print(f"asyncclcache: {e}", file=sys.stderr)
            return EXIT_USAGE
    args = parser.parse_args(argv)
    from .config import get_config

    try:
        get_config()  # a bad ASYNCCLCACHE_* setting is a usage error, named, not a traceback
    except ValueError as e:
        print(f"asyncclcache: {e}", file=sys.stderr)
        return EXIT_USAGE
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args.func(args))
    except UsageError as e:
        print(f"asyncclcache: {_printable(str(e))}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except OSError as e:
        where = _printable(str(getattr(e, "filename", "") or ""))
        print(f"asyncclcache: {e.strerror or e}: {where}", file=sys.stderr)
        return EXIT_USAGE
