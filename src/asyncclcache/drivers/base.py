"""The interface between the cache and a way of retrieving binaries."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyopencl as cl

    from ..keys import KeyInfo

__all__ = ["Done", "Driver", "Dropped", "Job"]


class Dropped(Exception):
    """A fetch abandoned because the cache is shutting down (counted as skipped)."""


@dataclass
class Job:
    """One built program whose binaries are wanted. Owned by the cache; mutated under its lock."""

    info: KeyInfo
    source: bytes
    options: bytes
    devices: Sequence[cl.Device]
    logs: list[str]
    #: The built program, kept alive for in-process strategies; ``None`` once done.
    program: Any = None
    #: Digest of the binaries last written, so a refresh writes only what changed.
    written_digest: str | None = None
    fetches: int = 0
    #: The per-key claim (store lock) while this process works on the key.
    claim: Any = None
    #: Another process claimed the key: this one leaves it alone.
    yielded: bool = False
    created: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return self.info.key


#: Called from a background thread with the binaries (one per device) or the error.
Done = Callable[[list[bytes] | None, BaseException | None], None]


class Driver(ABC):
    """Retrieves a job's binaries off the caller's thread and reports through ``done``.

    ``fetch`` is called on the caller's thread and must return at once.
    """

    name: str = ""
    #: Whether the driver needs the main process's program object.
    needs_program: bool = False

    @abstractmethod
    def fetch(self, job: Job, done: Done) -> None:
        """Queue a retrieval of ``job``'s binaries; ``done`` runs later in a background thread."""

    def close(self, timeout: float | None = None) -> None:  # noqa: B027 - optional hook
        """Release threads and processes; pending fetches may be dropped."""
