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


def drain(master: int, into: bytearray) -> None:
    """Read the terminal as a terminal emulator would (a full pty would block the node's logging)."""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the master end was closed by the test, or the node has gone
            return
        if not chunk:
            return
        into.extend(chunk)


def start_on_a_terminal(data_dir: Path, *, ignore_hangup: bool) -> tuple[subprocess.Popen, int, bytearray]:
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
    seen = bytearray()
    threading.Thread(target=drain, args=(master, seen), daemon=True).start()
    return proc, master, seen


def step_of(data_dir: Path) -> int:
    r = cli("node", "status", "--data-dir", str(data_dir), "--json")
    return json.loads(r.stdout)["training"]["step"] if r.returncode == 0 else -1


def wait_for_step(data_dir: Path, proc: subprocess.Popen, seen: bytearray, above: int) -> int:
    deadline = time.monotonic() + 90
    while (step := step_of(data_dir)) <= above:
        assert proc.poll() is None, bytes(seen[-3000:]).decode(errors="replace")
        assert time.monotonic() < deadline, bytes(seen[-3000:]).decode(errors="replace")
        time.sleep(0.3)  # sleep: poll interval
    return step


@pytest.mark.slow
@pytest.mark.parametrize("ignore_hangup", [False, True], ids=["terminal-closed", "nohup"])
def test_a_closed_terminal_stops_the_node_cleanly_unless_it_runs_under_nohup(tmp_path, ignore_hangup):
    d = tmp_path / "a"
    r = cli("swarm", "create", "--data-dir", str(d), "--model", "gpt-tiny", "--steps", "0")
    assert r.returncode == 0, r.stderr
    proc, master, seen = start_on_a_terminal(d, ignore_hangup=ignore_hangup)
    try:
        step = wait_for_step(d, proc, seen, above=0)
        assert b"\x1b[K" in seen  # the live status line was drawn on the terminal (redrawn in place)
        os.close(master)  # the terminal goes away: the kernel hangs up its session
        if ignore_hangup:
            after = wait_for_step(d, proc, seen, above=step + 20)  # still training, writing to nobody
            assert after > step and proc.poll() is None
            r = cli("node", "stop", "--data-dir", str(d), "--wait")
            assert r.returncode == 0, r.stdout + r.stderr
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 0, (rc, bytes(seen[-3000:]).decode(errors="replace"))
    latest = CheckpointStore(d / "checkpoints").load_latest()
    assert latest is not None and latest.step >= step  # its last step is on disk
    assert not (d / "daemon.json").exists()  # `node status` no longer finds a node that is gone
