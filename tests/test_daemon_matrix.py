"""Every built-in outer optimizer, and a `py:` one, as users run them: real `meshtrain node start`
/ `swarm join` processes on loopback, each optimizer with a quantised codec (the default codec of
diloco and dp is what the other daemon tests run).

One swarm per optimizer, one life story each (two daemons, to keep it CI-sized): both train; one
is killed with SIGKILL and started again from its data dir, where it resumes its checkpoint and,
the swarm having moved on meanwhile, downloads the swarm's state as a late joiner does; both stop
with Ctrl-C and exit 0. Every round's φ digest both nodes report must agree — except under
NoLoCo, whose replicas differ by design and only mix with a partner each round (they publish no
digest to compare): there, both must have averaged with a partner (a round's contributors: 2)
after the restart.
"""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest

from meshtrain.node.status.client import StatusError, fetch_status

from .test_node_cli import create, no_daemon_outlives_its_test, start, wait_daemon  # noqa: F401
from .test_rejoin import wait_for

pytestmark = pytest.mark.slow

CUSTOM_OUTER = Path(__file__).with_name("custom_outer.py")

CASES = {  # optimizer -> its spec flags
    "diloco": ["--codec", "int8"],
    "streaming": ["--codec", "fp4", "--fragments", "2"],
    "noloco": ["--codec", "int8"],
    "sparseloco": [],  # its own codec: top-k of the error-fed Δ, 2-bit values
    "dp": ["--codec", "bf16"],
    "py": ["--codec", "int8"],
}


def status(info: dict) -> dict | None:
    try:
        return fetch_status(info["status_url"])
    except (OSError, StatusError):  # between states
        return None


def rounds_of(info: dict) -> int:
    st = status(info)
    return st["training"]["round"] if st and st["node"]["state"] == "training" else -1


@pytest.mark.parametrize("optimizer", list(CASES))
def test_an_optimizer_trains_takes_a_late_joiner_and_survives_a_kill(optimizer, tmp_path):
    dirs = [tmp_path / n for n in "ab"]
    logs = [tmp_path / f"{n}.log" for n in "ab"]
    name = optimizer
    if optimizer == "py":
        shutil.copy(CUSTOM_OUTER, tmp_path / "outer.py")
        name = f"py:{tmp_path / 'outer.py'}:OuterSGD"
    H = "1" if optimizer == "dp" else "4"
    flags = ("--model", "gpt-tiny", "--steps", "0", "--H", H, "--eval-every", "0", "--optimizer", name)
    create(dirs[0], *flags, *CASES[optimizer])
    common = ("--checkpoint-every", "1")
    procs = [start("--data-dir", str(dirs[0]), *common, log=logs[0])]
    infos = [wait_daemon(dirs[0], procs[0], logs[0])]
    join = ("--join", infos[0]["addrs"][0])
    procs.append(start("--data-dir", str(dirs[1]), *join, *common, log=logs[1]))
    infos.append(wait_daemon(dirs[1], procs[1], logs[1]))
    wait_for("a and b to complete rounds together", lambda: min(rounds_of(i) for i in infos) >= 2)
    wait_for("b to have a checkpoint", lambda: list((dirs[1] / "checkpoints").glob("*")))

    procs[1].send_signal(signal.SIGKILL)
    procs[1].wait()
    (dirs[1] / "daemon.json").unlink()
    logs[1] = tmp_path / "b-again.log"
    procs[1] = start("--data-dir", str(dirs[1]), *join, *common, log=logs[1])
    infos[1] = wait_daemon(dirs[1], procs[1], logs[1])
    back_at = wait_for("b to train again", lambda: rounds_of(infos[1]) >= 0 and rounds_of(infos[1]) + 1)
    wait_for("b to complete rounds after its restart", lambda: rounds_of(infos[1]) >= back_at + 1)
    text = logs[1].read_text()
    assert "resumed from checkpoint" in text or "joined the swarm" in text, text[-3000:]

    def in_step() -> list[dict] | None:
        """Both statuses, once b's φ history shares a round with a's: b trains in the swarm's
        rounds again. (Its first rounds back may be its own: on a loaded machine a, alone, ran
        20 rounds ahead while b resumed and downloaded, and b re-synced once more.)"""
        docs = [status(i) for i in infos]
        if None in docs:
            return None
        if optimizer == "noloco":  # replicas differ by design: no digests to share
            return docs
        phis = [dict(st["training"]["phi_history"]) for st in docs]
        return docs if set(phis[0]) & set(phis[1]) else None

    docs = wait_for("a round whose φ both a and b hold", in_step)
    for p in procs:
        p.send_signal(signal.SIGINT)
    for p, log in zip(procs, logs, strict=True):
        assert p.wait(timeout=60) == 0, log.read_text()[-3000:]

    if optimizer == "noloco":
        for st in docs:
            pairs = [h["contributors"] for h in st["training"]["history"] if h["contributors"] is not None]
            assert pairs and max(pairs) == 2, pairs
        return
    phis = [{r: d for r, d in st["training"]["phi_history"]} for st in docs]
    shared = [r for r in phis[1] if r in phis[0]]
    assert shared, phis
    assert all(phis[0][r] == phis[1][r] for r in shared), phis
