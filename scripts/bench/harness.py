"""What the daemon benchmarks share: starting `meshtrain node start` processes, reading their
daemon.json and status, waiting on a condition with a deadline, and the one JSON line they end with.

A benchmark of real daemons (bench_node, bench_stop, bench_trainer, ...) drives them as a user
would: through the CLI, in their own processes, on loopback. `Daemon` is one such process: its
data dir, its log (stderr), the stdout whose last JSON line is the node's result. Every helper
raises `RuntimeError` naming the log to read when a node does not start or exits early, so a
benchmark's failure says where to look. A daemon still running when the benchmark's process
exits — a `wait_for` that timed out, any exception — is killed then (`atexit`), so a failed run
leaves no daemons loading the machine for the next one.

Run as scripts (`python scripts/bench/bench_x.py`), the benchmarks import this module by its
package path (`scripts.bench.harness`), which needs the repository root on `sys.path`: each
benchmark inserts `ROOT` before importing it.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[2]
# A daemon on loopback: any free port, any status port, one torch thread (several share 2 cores).
LOOPBACK = ["--listen", "/ip4/127.0.0.1/tcp/0", "--status-port", "0", "--threads", "1"]

T = TypeVar("T")
_running: list[Daemon] = []  # every Daemon started, for the exit handler


@atexit.register
def _kill_leftovers() -> None:
    for d in _running:
        d.kill()


def cli(*args: str, timeout: float = 120, **kw: Any) -> subprocess.CompletedProcess:
    """`meshtrain <args>`, run to completion from the repository root."""
    return subprocess.run(
        [sys.executable, "-m", "meshtrain.node.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


def create_swarm(data_dir: Path, *spec: str) -> Path:
    """`meshtrain swarm create --data-dir <data_dir> <spec flags>`; the spec file it wrote."""
    r = cli("swarm", "create", "--data-dir", str(data_dir), *spec)
    if r.returncode:
        raise RuntimeError(r.stderr)
    return data_dir / "swarm.json"


def wait_for(cond: Callable[[], T | None], timeout: float, what: str, poll: float = 0.5) -> T:
    """The first truthy value of `cond()`, polled every `poll` s; `RuntimeError` after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(poll)
    raise RuntimeError(f"timed out waiting for {what}")


class Daemon:
    """`meshtrain node start --data-dir <data_dir> <LOOPBACK> <args>` in its own process, its
    stderr appended to `log`. `loopback=False` leaves the listen flags to `args`."""

    def __init__(
        self,
        data_dir: Path,
        log: Path,
        *args: str,
        env: dict[str, str] | None = None,
        loopback: bool = True,
        log_level: str = "INFO",
    ) -> None:
        self.dir, self.log = data_dir, log
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {}))
        with open(log, "a") as err:
            self.p = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "meshtrain.node.cli",
                    "--log-level",
                    log_level,
                    "node",
                    "start",
                    "--data-dir",
                    str(data_dir),
                    *(LOOPBACK if loopback else []),
                    *args,
                ],
                cwd=ROOT,
                env=full_env,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        _running.append(self)

    def daemon(self, timeout: float = 120) -> dict:
        """The node's daemon.json (pid, peer id, addresses, status url) once it is up."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.p.poll() is not None:
                raise RuntimeError(f"node {self.dir} exited at start-up; see {self.log}")
            try:
                return json.loads((self.dir / "daemon.json").read_text())
            except (OSError, ValueError):
                time.sleep(0.1)
        raise RuntimeError(f"node {self.dir} did not start within {timeout:.0f} s; see {self.log}")

    def status(self) -> dict | None:
        """The node's status document, or None between states (the caller polls again)."""
        from meshtrain.node.status.client import fetch_status

        try:
            return fetch_status(self.daemon()["status_url"], timeout=5)
        except Exception:  # noqa: BLE001 — a node between states
            return None

    def wait(self, timeout: float) -> dict | None:
        """The node's result (its last JSON stdout line) once it exits 0; None if it failed or
        did not exit within `timeout` (then it is killed)."""
        try:
            out, _ = self.p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        return json.loads(lines[-1]) if lines and self.p.returncode == 0 else None

    def interrupt(self) -> None:
        """Ctrl-C: the node leaves the swarm and checkpoints."""
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGINT)

    def kill(self) -> None:
        """SIGKILL, as a crash."""
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGKILL)
        self.p.wait()


def emit(result: dict[str, Any]) -> None:
    """A benchmark's result: one JSON object, the last line of its stdout."""
    print(json.dumps(result), flush=True)
