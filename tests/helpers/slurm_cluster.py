"""A real single-node Slurm cluster for tests: munged + slurmctld + slurmd, private to one temp directory.

Debian's ``slurm-wlm`` and ``munge`` packages (.ci/install-slurm installs them as root). Everything lives under
the given directory: its own munge key and socket, its own ports, state and spool, so it never touches a
system-wide Slurm or another test run's cluster. ``start()`` returns None when up, else the reason it could not
start (tests skip with it); ``stop()`` ends the three daemons it started, by their pids.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Optional

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "squeue", "scontrol", "sinfo", "scancel")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _which(name: str) -> Optional[str]:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/sbin/{name}") if os.path.exists(p)), None)


class SlurmCluster:
    def __init__(self, root: Path, cpus: Optional[int] = None):
        self.root = Path(root)
        self.cpus = cpus or os.cpu_count() or 1
        self.procs: list[subprocess.Popen] = []
        self.conf = self.root / "slurm.conf"
        self.host = socket.gethostname().split(".")[0]

    @property
    def env(self) -> dict[str, str]:
        """What a client needs to reach this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def start(self, timeout_s: float = 60.0) -> Optional[str]:
        if os.geteuid() != 0:
            return "a private Slurm cluster needs root (slurmd runs jobs as any user)"
        missing = [d for d in DAEMONS if _which(d) is None] + [c for c in CLIENTS if shutil.which(c) is None]
        if missing:
            return (f"Slurm is not installed ({', '.join(missing)} missing): as root, `bash .ci/install-slurm` "
                    "(Debian packages slurm-wlm and munge)")
        try:
            self._start_munge()
            self._write_conf()
            env = {**os.environ, **self.env}
            for daemon in ("slurmctld", "slurmd"):
                log = open(self.root / f"{daemon}.stdout", "w")
                args = [_which(daemon), "-D"] + (["-i"] if daemon == "slurmctld" else [])
                self.procs.append(subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                   stdin=subprocess.DEVNULL, start_new_session=True))
            return self._wait_idle(timeout_s)
        except OSError as e:
            return f"could not start Slurm: {e}"

    def _start_munge(self) -> None:
        d = self.root / "munge"
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o755)
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        self.munge_socket = d / "munge.socket"
        args = [_which("munged"), "--foreground", "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
                f"--pid-file={d / 'munged.pid'}", f"--log-file={d / 'munged.log'}", f"--seed-file={d / 'seed'}"]
        log = open(d / "munged.stdout", "w")
        self.procs.append(subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           start_new_session=True))
        deadline = time.monotonic() + 15
        while not self.munge_socket.exists():
            if self.procs[-1].poll() is not None or time.monotonic() > deadline:
                raise OSError(f"munged did not start: {(d / 'munged.log').read_text(errors='replace')[-300:]}")
            time.sleep(0.1)

    def _write_conf(self) -> None:
        r = self.root
        for sub in ("state", "spool", "log"):
            (r / sub).mkdir(exist_ok=True)
        self.conf.write_text("\n".join([
            "ClusterName=megapipetest",
            f"SlurmctldHost={self.host}",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none",
            "ReturnToService=2",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=sched_interval=1",
            "MinJobAge=600",
            "KillWait=10",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
            f"NodeName={self.host} CPUs={self.cpus} State=UNKNOWN",
            f"PartitionName=test Nodes={self.host} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]))

    def _wait_idle(self, timeout_s: float) -> Optional[str]:
        deadline = time.monotonic() + timeout_s
        env = {**os.environ, **self.env}
        last = ""
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    return f"a Slurm daemon exited at start: {self._logs()}"
            res = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True)
            last = (res.stdout + res.stderr).strip()
            if res.returncode == 0 and last.rstrip("*") in ("idle", "mixed", "allocated"):
                return None
            time.sleep(0.5)
        return f"Slurm did not come up within {timeout_s:.0f} s (sinfo: {last!r}; {self._logs()})"

    def _logs(self) -> str:
        tails = []
        for name in ("slurmctld.log", "slurmd.log"):
            p = self.root / "log" / name
            if p.exists():
                tails.append(f"{name}: " + " | ".join(p.read_text(errors="replace").splitlines()[-3:]))
        return "; ".join(tails) or "no logs"

    def stop(self) -> None:
        if self.procs:  # jobs still queued or running would outlive their slurmd
            subprocess.run(["scancel", "--full", "--quiet", "--user", "root"], env={**os.environ, **self.env},
                           capture_output=True, timeout=30)
        for p in reversed(self.procs):  # slurmd, slurmctld, then munged
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.procs.clear()
