"""The spec's `pace` "swarm" (node/pace.py): real daemons, one of them slowed by its model (a
sleep in every training forward pass, scripts/bench/slowed_model.py — the model's, not
meshtrain's). The slow peer skips steps to reach each round when the fast one does: it takes
part in every round, weighted by what it trained, and is never re-synced for being slow."""

from __future__ import annotations

import json
import time

import pytest
import torch

from .conftest import ROOT
from .test_node_cli import cli, create, finish, phi, start, wait_daemon

SLOWED = ROOT / "scripts" / "bench" / "slowed_model.py"


@pytest.mark.slow
def test_a_slow_peer_keeps_the_swarms_pace_by_skipping_steps_and_joins_every_round(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    create(a, "--model", f"py:{SLOWED}:make", "--steps", "40", "--H", "10", "--eval-every", "0", "--pace", "swarm")
    la, lb = tmp_path / "a.log", tmp_path / "b.log"
    pa = start("--data-dir", str(a), "--wait-peers", "2", log=la)
    info = wait_daemon(a, pa, la)
    # 1 s a step: a round of 10 steps would take b 10 s, the fast peer well under one
    pb = start(
        "--data-dir", str(b), "--join", info["addrs"][0], "--wait-peers", "2", log=lb,
        env={"SLOWED_MODEL_SLEEP_S": "1.0"},
    )  # fmt: skip
    wait_daemon(b, pb, lb)
    # `node status` says what the slow peer skipped, while it runs
    deadline = time.monotonic() + 120
    while "steps to keep the swarm's pace" not in (out := cli("node", "status", "--data-dir", str(b)).stdout):
        assert time.monotonic() < deadline and pb.poll() is None, out
        time.sleep(0.5)  # sleep: poll interval
    ra, rb = finish(pa, la, timeout=240), finish(pb, lb, timeout=240)
    assert ra["step"] == rb["step"] == 40 and ra["rounds"] == rb["rounds"] == 4, (ra, rb)
    assert ra["skipped_steps"] == 0 and rb["skipped_steps"] >= 10, (ra, rb)  # b trained well under 40 steps
    log_b = lb.read_text()
    assert "behind the swarm: skipping steps" in log_b
    assert "out of step with the swarm" not in log_b and "proceeding alone" not in log_b, log_b[-3000:]
    # every round averaged both peers (b's weight, the share it trained, is above 0)
    history = json.loads((a / "history.json").read_text())
    assert {h["contributors"] for h in history if h["round"] >= 1} == {2}, history
    pa_, pb_ = phi(a), phi(b)
    assert all(torch.equal(pa_[n], pb_[n]) for n in pa_), "the peers must hold identical outer parameters"
