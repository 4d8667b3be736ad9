"""A real Slurm on this machine, for the tests: ``munged``, ``slurmctld`` and ``slurmd``
(Debian's ``slurm-wlm``), each private to one test session (its own key, socket, ports,
state and logs in a temporary folder), stopped at the end.

:func:`start` returns a :class:`Slurm` whose ``env`` runs ``srun`` against it, or says
why it cannot start here (not root, no Slurm installed, a daemon that did not come up).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "sinfo")


def _version() -> tuple[int, int]:
    r = subprocess.run(["slurmd", "-V"], capture_output=True, text=True, timeout=30, check=False)
    m = re.search(r"(\d+)\.(\d+)", r.stdout)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Slurm:
    """A running private Slurm: ``env`` for ``srun``; :meth:`stop` ends its daemons."""

    folder: Path
    env: dict[str, str]
    daemons: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def srun(self, n: int, *argv: str, env: dict[str, str] | None = None,
             timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """``srun -n N argv...`` (``--overcommit``: more tasks than this machine's cores)."""
        return subprocess.run(["srun", "--overcommit", "-n", str(n), *argv], capture_output=True,
                              text=True, env={**self.env, **(env or {})}, timeout=timeout, check=False)

    def start(self, *argv: str) -> subprocess.Popen[bytes]:
        """A daemon in the foreground, ours to stop (none outlives the tests)."""
        proc = subprocess.Popen(argv, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.daemons.append(proc)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.daemons):
            proc.terminate()
        for proc in reversed(self.daemons):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                         for p in sorted(self.folder.glob("*.log")))


def missing() -> str | None:
    """Why Slurm's programs are not here, or ``None``."""
    gone = [d for d in DAEMONS if shutil.which(d) is None]
    if gone:
        return f"Slurm is not installed here (no {', '.join(gone)}: apt-get install slurmctld slurmd slurm-client munge)"
    return None


def start(folder: Path) -> Slurm | str:
    """Start a private Slurm in ``folder``; a :class:`Slurm`, or why not (a string)."""
    if os.geteuid() != 0:
        return "a private Slurm needs root here (slurmd runs the tasks as their user)"
    if why := missing():
        return why
    folder.mkdir(parents=True, exist_ok=True)
    host = socket.gethostname().split(".")[0]
    key = folder / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    sock = folder / "munge.sock"
    for d in ("state", "spool"):
        (folder / d).mkdir(exist_ok=True)
    conf = folder / "slurm.conf"
    conf.write_text(f"""ClusterName=acctest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={sock}
CredType=cred/munge
StateSaveLocation={folder / 'state'}
SlurmdSpoolDir={folder / 'spool'}
SlurmctldPidFile={folder / 'slurmctld.pid'}
SlurmdPidFile={folder / 'slurmd.pid'}
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmctldLogFile={folder / 'slurmctld.log'}
SlurmdLogFile={folder / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
NodeName={host} NodeAddr=127.0.0.1 NodeHostname={host} CPUs=64 State=UNKNOWN
PartitionName=tests Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    slurm = Slurm(folder, env)
    if not os.path.ismount("/sys/fs/cgroup") and _version() >= (23, 2):
        # Slurm 23.02+ starts its cgroup plugin in slurmd whatever the proctrack plugin, and
        # fails where no cgroup file system is mounted (a chroot): it can be turned off.
        (folder / "cgroup.conf").write_text("CgroupPlugin=disabled\n")
    slurm.start("munged", "--foreground", "--force", f"--key-file={key}", f"--socket={sock}",
                f"--pid-file={folder / 'munged.pid'}", f"--log-file={folder / 'munged.log'}",
                f"--seed-file={folder / 'munged.seed'}")
    for _ in range(100):
        if sock.exists():
            break
        time.sleep(0.1)
    for daemon in ("slurmctld", "slurmd"):
        slurm.start(daemon, "-D")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        gone = [p.args[0] for p in slurm.daemons if p.poll() is not None]
        if gone:
            slurm.stop()
            return f"{', '.join(map(str, gone))} did not start\n{slurm.logs()}"
        r = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True,
                           timeout=30, check=False)
        if r.returncode == 0 and r.stdout.strip() in ("idle", "mixed", "allocated"):
            return slurm
        time.sleep(0.5)
    slurm.stop()
    return f"Slurm's node did not come up in 60 s\n{slurm.logs()}"
