"""A foreground node whose terminal goes away: closing an ssh session or a terminal window.

The kernel sends SIGHUP to a terminal's session when the terminal closes. A node killed by it
left no final checkpoint (a run of 4,000 steps lost them all: the first periodic checkpoint was
minutes away) and a stale daemon.json. Now SIGHUP stops a node as SIGTERM does — leave the swarm,
checkpoint, exit 0 — unless it is ignored when the node starts (`nohup`, or a supervisor that
ignores it): then the node keeps training, writes to the dead terminal are dropped, and a later
`node stop` still ends it with exit 0 and its checkpoint.

Real processes on a real pseudo-terminal: the node is a session leader whose controlling
terminal is the pty, and the test closes the pty's master end, which is what makes the kernel
send the SIGHUP — nothing here sends a signal itself.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

from meshtrain.node.state.checkpoint import CheckpointStore

from .conftest import ROOT

LOOPBACK = ["--listen", "/ip4/127.0.0.1/tcp/0", "--status-port", "0", "--threads", "1"]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "meshtrain.node.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


class Terminal:
    """The master end of a pty, read as a terminal emulator would (a full pty would block the
    node's logging). `hang_up()` closes it — on the reading thread, which owns the descriptor: a
    number closed under a thread still reading it may be reused by the next pipe this test opens."""

    def __init__(self, master: int) -> None:
        self.master = master
        self.seen = bytearray()
        self._closing = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            while not self._closing.is_set():
                if select.select([self.master], [], [], 0.1)[0]:
                    try:
                        chunk = os.read(self.master, 65536)
                    except OSError:  # EIO: the node (the slave's last holder) has gone
                        chunk = b""
                    if not chunk:
                        self._closing.wait()
                        break
                    self.seen.extend(chunk)
        finally:
            os.close(self.master)  # the terminal goes away: the kernel hangs up its session

    def hang_up(self) -> None:
        self._closing.set()
        self._reader.join(timeout=10)

    def text(self) -> str:
        return bytes(self.seen[-3000:]).decode(errors="replace")


def start_on_a_terminal(data_dir: Path, *, ignore_hangup: bool) -> tuple[subprocess.Popen, Terminal]:
    master, slave = os.openpty()

    def as_a_shell_would_start_it() -> None:
        os.setsid()  # its own session, with the pty as its controlling terminal
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        # What `nohup` does before it execs the command, or what a login shell leaves (the
        # default) — whatever this test runs under: a suite started under nohup passes SIG_IGN on.
        signal.signal(signal.SIGHUP, signal.SIG_IGN if ignore_hangup else signal.SIG_DFL)

    proc = subprocess.Popen(
        [sys.executable, "-m", "meshtrain.node.cli", "node", "start", "--data-dir", str(data_dir), *LOOPBACK],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        preexec_fn=as_a_shell_would_start_it,
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    os.close(slave)
    return proc, Terminal(master)


def step_of(data_dir: Path) -> int:
    r = cli("node", "status", "--data-dir", str(data_dir), "--json")
    return json.loads(r.stdout)["training"]["step"] if r.returncode == 0 else -1


def wait_for_step(data_dir: Path, proc: subprocess.Popen, terminal: Terminal, above: int) -> int:
    deadline = time.monotonic() + 90
    while (step := step_of(data_dir)) <= above:
        assert proc.poll() is None, terminal.text()
        assert time.monotonic() < deadline, terminal.text()
        time.sleep(0.3)  # sleep: poll interval
    return step


@pytest.mark.slow
@pytest.mark.parametrize("ignore_hangup", [False, True], ids=["terminal-closed", "nohup"])
def test_a_closed_terminal_stops_the_node_cleanly_unless_it_runs_under_nohup(tmp_path, ignore_hangup):
    d = tmp_path / "a"
    r = cli("swarm", "create", "--data-dir", str(d), "--model", "gpt-tiny", "--steps", "0")
    assert r.returncode == 0, r.stderr
    proc, terminal = start_on_a_terminal(d, ignore_hangup=ignore_hangup)
    try:
        step = wait_for_step(d, proc, terminal, above=0)
        assert b"\x1b[K" in terminal.seen  # the live status line was drawn on the terminal (redrawn in place)
        terminal.hang_up()
        if ignore_hangup:
            after = wait_for_step(d, proc, terminal, above=step + 20)  # still training, writing to nobody
            assert after > step and proc.poll() is None
            r = cli("node", "stop", "--data-dir", str(d), "--wait")
            assert r.returncode == 0, r.stdout + r.stderr
        rc = proc.wait(timeout=60)
    finally:
        terminal.hang_up()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 0, (rc, terminal.text())
    latest = CheckpointStore(d / "checkpoints").load_latest()
    assert latest is not None and latest.step >= step  # its last step is on disk
    assert not (d / "daemon.json").exists()  # `node status` no longer finds a node that is gone
