"""Yes/no settings from the environment: one spelling for every ``ASYNCCLCACHE_*`` flag.

Its own module, importing nothing, because the start-up hook reads flags in every
interpreter that sets ``ASYNCCLCACHE_INSTALL`` (:mod:`.config` pulls in dataclasses).
"""

from __future__ import annotations

__all__ = ["parse_bool"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def parse_bool(value: str | None, *, name: str = "value") -> bool | None:
    """``None`` for unset; ``True``/``False`` for the usual spellings; ``ValueError`` otherwise."""
    if value is None:
        return None
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"{name}: expected 0/1/true/false, got {value!r}")
