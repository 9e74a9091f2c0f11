"""Run an example script as two real peers on loopback: the first creates the swarm and prints
`{"addr": ...}` on stdout, the second joins through that address; each ends with one JSON line
(its result), which `run_two_peers` returns. Used by the integration tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def start_peer(script: Path, args: list[str], log: Path, launcher: tuple[str, ...] = ()) -> subprocess.Popen[str]:
    """`script` with `args` (`launcher`: what runs it, e.g. torchrun's module and flags). Its temp
    folder is beside `log`: torchrun leaves its log folder there, as it would in a user's /tmp."""
    tmp = log.with_suffix(".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [sys.executable, *launcher, str(script), *args],
        cwd=ROOT,
        env=dict(os.environ, TMPDIR=str(tmp)),
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
        start_new_session=True,  # `stop_peer` ends it with whatever it started (torchrun's ranks)
    )


def stop_peer(proc: subprocess.Popen[str]) -> None:
    """Kill `proc` and its process group (idempotent)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def first_json(proc: subprocess.Popen[str], log: Path, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("{"):
            return json.loads(line)
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"no address printed; log:\n{log.read_text()[-3000:]}")


def run_two_peers(
    script: Path, create: list[str], join: list[str], tmp_path: Path, join_launcher: tuple[str, ...] = ()
) -> tuple[dict, dict]:
    """(the creator's result, the joiner's result); the creator's address is appended to `join`
    (which ends with the script's join flag); `join_launcher` runs the joiner (`start_peer`)."""
    a_log, b_log = tmp_path / "a.log", tmp_path / "b.log"
    a = start_peer(script, create, a_log)
    try:
        addr = first_json(a, a_log)["addr"]
        b = start_peer(script, [*join, addr], b_log, join_launcher)
        try:
            outs = []
            for p, log in ((a, a_log), (b, b_log)):
                out, _ = p.communicate(timeout=300)
                assert p.returncode == 0, log.read_text()[-4000:]
                outs.append(json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1]))
        finally:
            stop_peer(b)
    finally:
        stop_peer(a)
    return outs[0], outs[1]


def loss_fell(losses: list[float]) -> bool:
    """The mean of the last quarter of the losses is below that of the first quarter."""
    k = max(1, len(losses) // 4)
    return sum(losses[-k:]) / k < sum(losses[:k]) / k
