"""What the package knows of one OpenCL implementation: the one kind of record that each
module of :mod:`asyncclcache.platforms` fills in (:class:`Platform`), with the settings
that change its code (:class:`Settings`) and its own disk cache's layout (:class:`Layout`).

Facts only: names, patterns, rules as measured, and the sentences that explain them. The
mechanisms that use them (finding a build's files, snapshots, restores) are the drivers'
(:mod:`asyncclcache.drivers`); the policy of a key is :mod:`asyncclcache.keys`'. Frozen
records whose hooks are pure functions of the environment: thread- and process-safe.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyopencl as cl

__all__ = ["Layout", "Part", "Platform", "Settings"]


@dataclass(frozen=True)
class Settings:
    """What of its environment one OpenCL implementation reads that changes the code it
    generates (docs/design.md "Settings in the key, per driver").

    Every variable whose name starts with one of ``prefixes`` is in the key, except those
    in ``not_code`` (where files go, logging, threads, which devices: none of them changes
    a binary): when in doubt, in. ``files`` digests the files that the driver reads as
    settings, ``{field: digest}``, and says why one cannot be known (then nothing is
    cached). ``at_start``: the driver reads all this once, when it starts, so a process
    keeps its first answer (measured on Intel's runtime: a ``cl.cfg`` or ``CL_CONFIG_*``
    changed after the platform started changes no code; Mesa's and NVIDIA's read theirs
    at device creation); pocl reads its own at every build. ``per_device``: settings that
    only some of its devices read (pocl's CUDA device), from the environment given.
    ``extra_options``: variables whose value the driver adds to every build's options
    (scanned like the options for what moves the include search). ``per_device_files``:
    ``per_device`` also reads files (libdevice), so a repeated build's key is made again.
    """

    prefixes: tuple[str, ...]
    not_code: frozenset[str] = frozenset()
    files: Callable[[], tuple[dict[str, str], str | None]] | None = None
    at_start: bool = True
    per_device: Callable[[cl.Device, Mapping[str, str]], dict[str, str]] | None = None
    extra_options: tuple[str, ...] = ()
    per_device_files: bool = False

    @property
    def from_environment(self) -> bool:
        """Whether the environment alone decides these settings for the rest of the process
        (what a key made once may be reused for: :mod:`asyncclcache.keys`)."""
        return (self.files is None or self.at_start) and not self.per_device_files

    def select(self, env: Mapping[str, str]) -> dict[str, str]:
        """The variables of ``env`` that are in the key. Pure: thread-safe."""
        return {k: v for k, v in env.items() if k.startswith(self.prefixes) and k not in self.not_code}

    def own(self, env: Mapping[str, str]) -> dict[str, str]:
        """Every variable of ``env`` that the implementation reads (its prefixes), code or not."""
        return {k: v for k, v in env.items() if k.startswith(self.prefixes)}


@dataclass(frozen=True)
class Layout:
    """How an implementation's own disk cache names its files, for the releases measured.

    Two shapes: one file per item, named by a hash of what the driver compiled (NVIDIA,
    Mesa: ``program_file`` is ``None``), or one folder per program (pocl: every field).
    """

    #: The driver that stores this cache (the strategy ``kcache`` resolves to), as entries record it.
    strategy: str
    #: What to call it in messages.
    what: str
    #: The relative path (``/``-separated) of a file that may be stored; nothing else is.
    pattern: re.Pattern[str]
    #: Directory levels above an item file (one file per item), or above a program's folder.
    depth: int
    #: Seconds after a build to wait for files the driver writes later (at the latest).
    settle: float
    #: Seconds a hurried snapshot or check still waits: what the driver hands to a writer
    #: thread of its own (Mesa's ``disk_cache_put`` queue) lands a little after the launch.
    grace: float = 0.0
    #: One folder per program: the file without which a folder holds no program.
    program_file: str | None = None
    #: The file that every build of the program touches, hit or miss (never stored).
    touched_file: str | None = None
    #: The name prefix of the generic variant's folder (made by binary queries, never by a launch).
    generic_prefix: str | None = None
    #: A variant is compiled once it holds a ``<kernel>.*`` file but these suffixes: its
    #: files written before the compiled one (which releases name differently).
    unfinished: tuple[str, ...] = ()
    #: One folder per program: launches add files to it (pocl's CPU devices compile a
    #: variant per launch); ``False``: the build writes them all (pocl's CUDA device).
    launches_add: bool = True

    def valid(self, rel: str) -> bool:
        """``rel`` is a name this cache may hold (plain names, no ``..``, no absolute path)."""
        return self.pattern.fullmatch(rel) is not None

    @property
    def per_program(self) -> bool:
        """One folder per program (pocl), not one file per item."""
        return self.program_file is not None


#: ``(folder, "")``, or ``(None, why not)``: where an implementation's cache is now for some
#: of its devices, and whether it is on.
Locate = Callable[[Sequence["cl.Device"]], tuple[Path | None, str]]


@dataclass(frozen=True)
class Part:
    """One of several caches that a device uses together, stored as one entry (pocl's CUDA
    device: pocl's folder per program and NVIDIA's compute cache): the folder its files
    take in an entry, its layout, and where it is now and whether it is on."""

    prefix: str
    layout: Layout
    locate: Locate


#: ``(options, working directory) -> (folder, doubt)``: see :attr:`Platform.include_rule`.
IncludeRule = Callable[[bytes, str | None], tuple[str | None, str | None]]


@dataclass(frozen=True)
class Platform:
    """Everything the package knows of one OpenCL implementation, in one place.

    A field left at its default means "not known here": the implementation's identity
    (driver version) is still in every key, its settings are not; no cache of its own is
    stored; where it looks for the source's own includes was not measured (a doubt); its
    binary query is a copy (``auto`` picks ``thread``).
    """

    #: Its OpenCL platform names (``platform.name``), the current first.
    names: tuple[str, ...]
    #: The settings that change its code.
    settings: Settings | None = None
    #: Its own disk cache, and :attr:`locate`, where it is now and whether it is on.
    layout: Layout | None = None
    locate: Locate | None = None
    #: Why ``auto`` stores its own cache (``{root}``: the cache's folder).
    why_cache: str = ""
    #: Where its compiler looks first for the source's own ``#include "..."``, and a doubt
    #: about it (then an include found there, and not on the include path, is uncertain).
    include_rule: IncludeRule | None = None
    #: The devices whose binary query compiles (docs/design.md F1): no binary is taken in
    #: the job's process there, so where its own cache is not stored ``auto`` picks ``off``
    #: (built plainly, counted ``cache_off``), and :attr:`why_off` says why and what to do.
    query_compiles: Callable[[cl.Device], bool] | None = None
    why_off: str = ""
    #: A record of some of an implementation's devices only (pocl's CUDA device): which.
    #: Such a record is found by :func:`asyncclcache.platforms.of_devices`, not by name.
    devices: Callable[[cl.Device], bool] | None = None
    #: Its cache is several caches, stored together (``layout`` names the whole, ``locate``
    #: says which parts are on); the driver stores each part's files under its prefix.
    parts: tuple[Part, ...] = ()

    def __post_init__(self) -> None:
        if (self.layout is None) != (self.locate is None):
            raise ValueError(f"{self.names[0]}: a layout and where it lives go together")
