"""Monitoring as operators run it: a real Prometheus server scrapes two live nodes' `/metrics`, and
every query of the shipped Grafana dashboard (docs/monitoring/grafana-dashboard.json) runs against
it and returns series — so the dashboard cannot name a metric the nodes do not serve. One of the
nodes also writes TensorBoard event files (`--tensorboard`), read back here record by record.

Needs Debian's `prometheus` binary (`.ci/run` installs it as root); skipped, with the reason,
where it is missing.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import struct
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from scripts.bench.harness import Daemon, create_swarm

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "docs" / "monitoring" / "grafana-dashboard.json"
PROMETHEUS = shutil.which("prometheus")


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL expression) of every panel's targets."""
    board = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in board["panels"] for t in p["targets"]]


def test_the_dashboard_queries_only_metric_families_the_status_page_documents():
    families = {m for _, expr in dashboard_queries() for m in re.findall(r"meshtrain_[a-z_]+", expr)}
    documented = (ROOT / "docs" / "monitoring" / "README.md").read_text()
    assert families and all(f in documented for f in families), families


def scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files under `logdir`: tag -> [(step, value)], in file order.
    Event files are TFRecords (length, its CRC, an `Event` protobuf, its CRC)."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack_from("<Q", data, at)
            event = Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def query(base: str, expr: str) -> list[dict]:
    """The result vector of an instant PromQL query; AssertionError if Prometheus refuses it."""
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def wait_until(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.5)  # sleep: poll interval of a scrape that happens every second
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
@pytest.mark.skipif(PROMETHEUS is None, reason="no `prometheus` binary (Debian: apt install prometheus)")
def test_prometheus_scrapes_two_nodes_and_every_dashboard_query_returns_series(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    create_swarm(a, "--model", "gpt-tiny", "--steps", "0", "--H", "5", "--eval-every", "10")
    nodes = [Daemon(a, tmp_path / "a.log", "--tensorboard", str(tmp_path / "tb"))]
    prom = None
    try:
        addr = nodes[0].daemon()["addrs"][0]
        nodes.append(Daemon(b, tmp_path / "b.log", "--join", addr))
        targets = [urllib.parse.urlparse(n.daemon()["status_url"]).netloc for n in nodes]
        config = tmp_path / "prometheus.yml"
        config.write_text(
            json.dumps(  # YAML is a superset of JSON
                {
                    "global": {"scrape_interval": "1s"},
                    "scrape_configs": [{"job_name": "meshtrain", "static_configs": [{"targets": targets}]}],
                }
            )
        )
        port = free_port()
        prom = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(tmp_path / "prometheus.log", "w"),  # noqa: SIM115 — closed with the process
        )
        base = f"http://127.0.0.1:{port}"

        def both_nodes_past_a_round_and_an_evaluation() -> bool:
            try:
                rounds = query(base, "meshtrain_round >= 1")
                evals = query(base, "meshtrain_eval_loss")
            except OSError:  # Prometheus is still starting
                return False
            return len(rounds) == 2 and len(evals) == 2

        wait_until(both_nodes_past_a_round_and_an_evaluation, 120, "both nodes' rounds and held-out loss in Prometheus")
        steps = {s["metric"]["instance"]: float(s["value"][1]) for s in query(base, "meshtrain_step")}
        assert set(steps) == set(targets) and all(v > 0 for v in steps.values()), steps
        # rate() over the counters needs two scrapes after the first round: wait until every
        # panel has series, or name the ones that never get any
        empty: list[str] = []

        def every_panel_has_series() -> bool:
            empty[:] = [title for title, expr in dashboard_queries() if not query(base, expr)]
            return not empty

        try:
            wait_until(every_panel_has_series, 30, "every dashboard panel to have series")
        except AssertionError:
            raise AssertionError(f"dashboard panels without series: {empty}") from None
    finally:
        if prom is not None:
            prom.terminate()
            prom.wait(timeout=30)
        for n in nodes:
            n.interrupt()
        for n in nodes:
            n.wait(60)
    written = scalars(tmp_path / "tb")
    losses = written["loss/train"]
    assert len(losses) >= 2 and [s for s, _ in losses] == sorted({s for s, _ in losses}), losses
    assert written["loss/held_out"] and written["swarm/round"][-1][1] >= 1 and written["bytes/sent"][-1][1] > 0
