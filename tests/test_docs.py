"""Every shell block of README.md and docs/*.md marked runnable (an HTML comment,
``<!-- runnable -->``, on the line before its fence: GitHub shows nothing of it) runs as
written, on real pocl, as a user runs it after the README's set-up: in the checkout
(here a folder of links to it, ``.venv`` the environment of these tests), with the
environment's ``bin/`` first on the PATH, a fresh HOME (so the default cache directory and
pocl's kernel cache are new), none of the tests' ``ASYNCCLCACHE_*`` settings, and
``bash -e``: a command that fails fails the test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

MARK = "<!-- runnable -->"
FENCE = re.compile(r"^```(sh|bash|console)\s*$")
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(paths: list[Path] = DOCS) -> list[tuple[str, str]]:
    """``(file:line, text)`` of each marked block; a mark not on a shell fence is an error."""
    found = []
    for path in paths:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip() != MARK:
                continue
            where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{i + 2}"
            if i + 1 >= len(lines) or not FENCE.match(lines[i + 1]):
                raise ValueError(f"{where}: {MARK} must be followed by a ```sh fence")
            end = next((j for j in range(i + 2, len(lines)) if lines[j].startswith("```")), None)
            if end is None:
                raise ValueError(f"{where}: the block is not closed")
            found.append((where, "\n".join(lines[i + 2:end]) + "\n"))
    return found


def run_block(text: str, work: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``text`` run by ``bash -e`` in a checkout-like folder under ``work``, as a new user."""
    checkout, home, tmp = work / "checkout", work / "home", work / "tmp"
    for d in (checkout, home, tmp):
        d.mkdir(parents=True, exist_ok=True)
    for entry in ROOT.iterdir():
        if entry.name not in (".venv", ".demo-cache", ".git") and not (checkout / entry.name).exists():
            (checkout / entry.name).symlink_to(entry)
    if not (checkout / ".venv").exists():
        (checkout / ".venv").symlink_to(sys.prefix)
    bindir = str(Path(sys.prefix) / "bin")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ASYNCCLCACHE_", "POCL_", "XDG_", "PYTEST_", "VIRTUAL_ENV", "COLUMNS"))
           and k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(HOME=str(home), TMPDIR=str(tmp), PATH=bindir + os.pathsep + env.get("PATH", ""))
    if "PYTHONPATH" in os.environ:  # a run of the tests against a source tree (not `make test`)
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return subprocess.run(["bash", "-e", "-o", "pipefail", "-c", text], cwd=checkout, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_the_docs_mark_their_runnable_blocks() -> None:
    where = [w for w, _ in blocks()]
    # The README's set-up and use, the command's page and the MPI example at least.
    assert {w.split(":")[0] for w in where} >= {"README.md", "docs/cli.md", "docs/mpi.md"}, where


def test_a_mark_on_anything_but_a_shell_block_is_an_error(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(f"text\n\n{MARK}\n```python\nprint(1)\n```\n")
    with pytest.raises(ValueError, match=r"doc.md:4: .* must be followed by a ```sh fence"):
        blocks([doc])


def test_a_wrong_command_fails_its_block(tmp_path: Path) -> None:
    # The runner can fail: a command that fails, even before the last line, fails the block.
    bad = run_block("asyncclcache info\nasyncclcache bogus-command\necho reached\n", tmp_path)
    assert bad.returncode != 0 and "reached" not in bad.stdout, bad.stdout
    assert run_block("asyncclcache --version\n", tmp_path).returncode == 0


@pytest.mark.parametrize(("where", "text"), blocks(), ids=[w for w, _ in blocks()])
def test_runnable_block(where: str, text: str, tmp_path: Path) -> None:
    proc = run_block(text, tmp_path)
    assert proc.returncode == 0, f"{where} failed ({proc.returncode}):\n{text}\nstdout:\n{proc.stdout[-3000:]}" \
                                 f"\nstderr:\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr
