"""Start-up never freezes the node (node/daemon.py, "Start-up never freezes the node"): while the
model and data are prepared — here a py: model factory that takes as long as the test wants, as
loading a real model or tokenising a real corpus takes minutes — the node's status page answers
(state "preparing", saying what it waits for), and `node stop` or Ctrl-C ends it at once with the
one-line "stopped while preparing" and exit code 130, although the preparation never returned."""

from __future__ import annotations

import json
import signal
import time

import pytest

from meshtrain.node.state.checkpoint import CheckpointStore

from .test_node_cli import cli, create, no_daemon_outlives_its_test, start, wait_daemon  # noqa: F401 — a fixture

pytestmark = pytest.mark.slow

# A model that takes until the test releases it to build: it says when it has begun.
SLOW_FACTORY = """
import os
import pathlib
import time

from meshtrain.models import GPT, GPTConfig

GATE = pathlib.Path(os.environ["MESHTRAIN_TEST_GATE"])


def make(vocab_size):
    (GATE.parent / "building").touch()
    while not GATE.exists():
        time.sleep(0.05)  # sleep: a build that lasts until the test releases it
    return GPT(GPTConfig.tiny(vocab_size), seed=0)
"""


@pytest.mark.parametrize("how", ["node stop", "ctrl-c"])
def test_a_node_preparing_its_model_answers_status_and_stops_at_once(tmp_path, monkeypatch, how):
    factory = tmp_path / "slow_model.py"
    factory.write_text(SLOW_FACTORY)
    monkeypatch.setenv("MESHTRAIN_TEST_GATE", str(tmp_path / "never"))  # the model never finishes
    d, log = tmp_path / "a", tmp_path / "a.log"
    create(d, "--model", f"py:{factory}:make", "--steps", "0", "--eval-every", "0")
    p = start("--data-dir", str(d), log=log)
    wait_daemon(d, p, log)  # daemon.json comes before the trainer: `node status/stop` find a preparing node
    deadline = time.monotonic() + 60
    while not (tmp_path / "building").exists():
        assert p.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)  # sleep: poll interval
    r = cli("node", "status", "--data-dir", str(d), "--json")
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert st["node"]["state"] == "preparing", st["node"]
    assert "preparing" in (st["training"]["waiting"] or ""), st["training"]
    t0 = time.monotonic()
    if how == "node stop":
        r = cli("node", "stop", "--data-dir", str(d))
        assert r.returncode == 0, r.stderr
    else:
        p.send_signal(signal.SIGINT)
    p.communicate(timeout=30)
    stopped_in = time.monotonic() - t0
    text = log.read_text()
    assert p.returncode == 130 and "Traceback" not in text, text[-3000:]
    assert text.strip().splitlines()[-1] == "meshtrain: stopped while preparing the model and data; nothing was trained"
    # Not a timing target (benchmarks hold those): a stop that waited for the model would never come.
    assert stopped_in < 20, stopped_in
    assert not (d / "daemon.json").exists()
    assert CheckpointStore(d / "checkpoints").load_latest() is None  # nothing trained, nothing saved
