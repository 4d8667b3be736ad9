"""The set-up that `make test` and `make demo` run (scripts/setup.sh, scripts/apt.sh) and the
tests' rule for what it installs (tests/_need.py): apt's lock is waited for, bounded; a
package that cannot be installed is named and stops the set-up; under CI=true a component
that is missing fails its tests instead of skipping them.

apt itself is replaced by a stand-in here (installing packages for real is `make test`'s
own proof): ``apt-get`` and ``dpkg-query`` on the PATH, with their state in a folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

APT_GET = r"""#!/usr/bin/env bash
# A stand-in for apt-get: the lock held for the first $(cat locked) calls; packages listed in
# broken cannot be installed; the others are installed as files in $APT_STATE.
echo "$*" >> "$APT_STATE/calls"
n=$(cat "$APT_STATE/locked" 2>/dev/null || echo 0)
if [ "$n" -gt 0 ]; then
    echo $((n - 1)) > "$APT_STATE/locked"
    echo "E: Could not get lock /var/lib/dpkg/lock-frontend. It is held by process 4242 (apt-get)" >&2
    exit 100
fi
args=(); for a in "$@"; do case "$a" in -o) skip=1 ;; -*) ;; *) [ -n "${skip:-}" ] && skip= || args+=("$a") ;; esac; done
[ "${args[0]}" = update ] && exit 0
for p in "${args[@]:1}"; do
    if grep -qx "$p" "$APT_STATE/broken" 2>/dev/null; then echo "E: Unable to locate package $p" >&2; exit 100; fi
done
for p in "${args[@]:1}"; do touch "$APT_STATE/$p"; done
"""

DPKG_QUERY = r"""#!/usr/bin/env bash
p="${!#}"
[ -e "$APT_STATE/$p" ] && printf 'install ok installed' || exit 1
"""


def _apt(tmp_path: Path, script: str, *, locked: int = 0, broken: tuple[str, ...] = (),
         installed: tuple[str, ...] = (), **env: str) -> subprocess.CompletedProcess[str]:
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir()
    state.mkdir()
    for name, text in (("apt-get", APT_GET), ("dpkg-query", DPKG_QUERY)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (state / "locked").write_text(str(locked))
    (state / "broken").write_text("".join(f"{b}\n" for b in broken))
    for p in installed:
        (state / p).touch()
    e = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", APT_STATE=str(state),
             APT_SUDO="env", APT_LOCK_POLL="0.1", **env)
    return subprocess.run(["bash", "-c", f"set -euo pipefail; . scripts/apt.sh; {script}"], cwd=ROOT, env=e,
                          capture_output=True, text=True, timeout=120, check=False)


def _calls(tmp_path: Path) -> list[str]:
    f = tmp_path / "state" / "calls"
    return f.read_text().splitlines() if f.exists() else []


def test_setup_waits_for_apts_lock_then_installs(tmp_path: Path) -> None:
    r = _apt(tmp_path, 'apt_install "for a test" strace e2fsprogs', locked=3)
    assert r.returncode == 0, r.stderr
    assert "installing Debian's strace e2fsprogs (for a test)" in r.stderr
    assert r.stderr.count("holds the lock; waiting up to 600 s") == 1, r.stderr  # said once
    assert (tmp_path / "state" / "strace").exists() and (tmp_path / "state" / "e2fsprogs").exists()
    assert len(_calls(tmp_path)) == 5  # 3 refused, update, install


def test_setup_waits_for_the_lock_no_longer_than_its_bound(tmp_path: Path) -> None:
    r = _apt(tmp_path, 'apt_install "for a test" strace', locked=10**6, APT_LOCK_WAIT="1")
    assert r.returncode != 0 and "apt's lock still held after 1 s" in r.stderr, r.stderr
    assert not (tmp_path / "state" / "strace").exists()


def test_setup_names_the_package_that_could_not_be_installed(tmp_path: Path) -> None:
    r = _apt(tmp_path, 'apt_install "the tests\' Slurm" --no-install-recommends slurmd munge slurmctld; echo after',
             broken=("munge",))
    assert r.returncode != 0 and "after" not in r.stdout, r.stdout  # the set-up stops
    assert "could not install Debian's munge (the tests' Slurm)" in r.stderr, r.stderr
    assert "Unable to locate package munge" in r.stderr
    # The others, tried alone, are there: the one named is the one that failed.
    assert (tmp_path / "state" / "slurmd").exists() and (tmp_path / "state" / "slurmctld").exists()
    assert all("--no-install-recommends" in c for c in _calls(tmp_path) if " update" not in c)


def test_setup_installs_nothing_that_is_there(tmp_path: Path) -> None:
    r = _apt(tmp_path, 'apt_install "for a test" strace', installed=("strace",))
    assert r.returncode == 0 and r.stderr == "" and _calls(tmp_path) == [], r.stderr


def test_setup_hides_no_failure() -> None:
    # Each failure must stop the set-up or be said: no `|| true`, no output thrown away unread.
    for script in ("scripts/setup.sh", "scripts/apt.sh"):
        text = (ROOT / script).read_text()
        assert "|| true" not in text and "2>/dev/null || true" not in text, script
    assert "set -euo pipefail" in (ROOT / "scripts/setup.sh").read_text()


NEEDY = """
from _need import need

def test_needs_a_thing():
    need("the thing", "the thing is not installed")
"""


def test_a_missing_component_skips_but_fails_under_ci(tmp_path: Path) -> None:
    (tmp_path / "test_needy.py").write_text(NEEDY)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = str(ROOT / "tests") + os.pathsep + env.get("PYTHONPATH", "")
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
            str(tmp_path / "test_needy.py")]
    plain = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert plain.returncode == 0 and "1 skipped" in plain.stdout, plain.stdout
    ci = subprocess.run(argv, cwd=tmp_path, env=dict(env, CI="true"), capture_output=True, text=True, timeout=120,
                        check=False)
    assert ci.returncode == 1 and "CI=true and the thing is missing" in ci.stdout, ci.stdout
