"""The dashboard in a real headless Chromium, against a running two-node swarm.

The page must load from the node itself (no CDN: Chromium runs with background networking off
on a machine with no outside network) and, once its script has polled `/status`, list both live
peers with their connection type and draw the loss curve. Chromium comes from Debian's
`chromium` package, which `.ci/run` installs.
"""

from __future__ import annotations

import html.parser
import shutil
import subprocess
import time

import pytest

from .test_node_cli import finish, two_nodes

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class _Peers(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.peers: dict[str, list[str]] = {}
        self.series: set[str] = set()
        self._row: str | None = None
        self.loaded = False

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        if tag == "tr" and "data-peer" in a:
            self._row = a["data-peer"]
            self.peers[self._row] = []
        if tag == "polyline" and "data-series" in a:
            self.series.add(a["data-series"])
        if tag == "body" and a.get("data-loaded") == "1":
            self.loaded = True

    def handle_endtag(self, tag: str) -> None:
        if tag == "tr":
            self._row = None

    def handle_data(self, data: str) -> None:
        if self._row and data.strip():
            self.peers[self._row].append(data.strip())


def render(url: str, user_dir: str) -> _Peers:
    out = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={user_dir}",
            "--virtual-time-budget=4000",
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    p = _Peers()
    p.feed(out.stdout)
    return p


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (installed by .ci/run)")
def test_dashboard_shows_the_live_peers_of_a_running_swarm(tmp_path):
    (_, pa, la, info), (_, pb, lb, info_b) = two_nodes(tmp_path, "--eval-every", "20")
    try:
        deadline = time.monotonic() + 90
        while True:
            page = render(info["status_url"], str(tmp_path / "chromium"))
            # b is listed from its start (as syncing, while it prepares and downloads): wait until it trains
            trains = "trainer" in page.peers.get(info_b["peer_id"], [])
            if page.loaded and len(page.peers) == 2 and "eval_loss" in page.series and trains:
                break
            assert time.monotonic() < deadline, (page.peers, page.series, page.loaded)
            time.sleep(1)  # sleep: poll interval
        assert set(page.peers) == {info["peer_id"], info_b["peer_id"]}
        mine = page.peers[info["peer_id"]]
        other = page.peers[info_b["peer_id"]]
        assert any("this node" in c for c in mine)
        assert "trainer" in other and "direct" in other, other  # role and connection type are shown
        assert "loss" in page.series
    finally:
        for p in (pa, pb):
            p.terminate()
        for p, log in ((pa, la), (pb, lb)):
            finish(p, log, timeout=60)
