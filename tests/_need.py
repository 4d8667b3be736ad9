"""``need(component, why)``: a test's skip for a component that ``make test`` installs."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

#: GitHub and GitLab set CI=true: there a component that `make test` installs must be there.
CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes", "on")


def need(component: str, why: str) -> NoReturn:
    """Skip the test: ``component``, which ``make test`` installs (scripts/setup.sh), is
    absent here, for ``why``. Under ``CI=true`` a failure instead: a green CI run must not
    have tested less. Not for what no CI machine has (pocl's CUDA device: a GPU), nor for
    what the machine forbids (root, mounts): those skip."""
    if CI:
        pytest.fail(f"CI=true and {component} is missing: {why}", pytrace=False)
    pytest.skip(why, allow_module_level=True)
