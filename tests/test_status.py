"""The status endpoint over real HTTP on loopback: JSON, Prometheus, the dashboard, stop, export.

It is never blocked behind the node: with the trio thread stuck, `/status` answers with the last
document and `POST /stop` is accepted.

The snapshot here is a fixed document (the endpoint is what is under test; `test_node_cli.py`
and `test_dashboard_browser.py` serve a real node's). Hostile clients — garbage request lines,
huge headers, a connection that says nothing, a wrong token — get an error and leave the
server serving.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from meshtrain.errors import ConfigError
from meshtrain.node.status.client import (
    StatusError,
    fetch_status,
    read_daemon_file,
    request_export,
    request_stop,
    wait_for_exit,
)
from meshtrain.node.status.server import StatusServer


def snapshot() -> dict:
    peers = [
        {
            "peer_id": f"12D3KooWpeer{i}",
            "addr": f"/ip4/127.0.0.1/tcp/{4000 + i}",
            "connection": c,
            "role": "trainer",
            "step": 10 + i,
            "loss": 2.0 + i,
            "last_seen_s": 0.5,
            "reachability": r,
        }
        for i, (c, r) in enumerate([("direct", "public"), ("relay", "private")])
    ]
    return {
        "node": {
            "peer_id": "12D3KooWpeer0",
            "name": "n0",
            "version": "0.1.0",
            "started": 0.0,
            "uptime_s": 3.5,
            "swarm": "ms0123",
            "state": "training",
            "listen": [],
            "reachability": "public",
            "connections": {
                "connections": 5,
                "max_peers": 4,
                "wanted": 4,
                "unwanted": 1,
                "closed": 7,
                "one_off_closed": 3,
            },
        },
        "training": {
            "step": 10,
            "round": 2,
            "loss": 2.25,
            "eval_loss": None,
            "optimizer": "diloco",
            "samples_per_s": 7.5,
            "bytes_sent": 4096,
            "bytes_received": 8192,
            "history": [{"step": s, "t": 0.0, "loss": 3 - s / 10, "eval_loss": None} for s in range(10)],
            "refused": {"not-a-member": 3},
            "parity": {"status": "minority", "resyncs": 1},
        },
        "peers": peers,
        "checkpoint": {},
        "joined_from": None,
    }


def get(url: str) -> tuple[int, str, bytes]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.headers["Content-Type"], r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read()


async def test_status_metrics_and_dashboard_are_served():
    async with StatusServer(snapshot, port=0) as srv:
        st = await trio.to_thread.run_sync(fetch_status, srv.url)
        assert st == snapshot()
        code, ctype, body = await trio.to_thread.run_sync(get, srv.url + "/metrics")
        assert code == 200 and ctype.startswith("text/plain")
        fams = {f.name: f for f in text_string_to_metric_families(body.decode())}
        assert fams["meshtrain_step"].samples[0].value == 10
        assert fams["meshtrain_loss"].samples[0].value == 2.25
        assert "meshtrain_eval_loss" not in fams  # unknown yet: absent, not a made-up 0
        assert fams["meshtrain_bytes_sent"].samples[0].value == 4096
        assert fams["meshtrain_live_peers"].samples[0].value == 2
        assert fams["meshtrain_connections"].samples[0].value == 5
        assert fams["meshtrain_max_peers"].samples[0].value == 4
        assert fams["meshtrain_connections_closed"].samples[0].value == 7
        assert fams["meshtrain_one_off_connections_closed"].samples[0].value == 3
        by_peer = {s.labels["peer"]: s for s in fams["meshtrain_peer_step"].samples}
        assert by_peer["12D3KooWpeer1"].value == 11 and by_peer["12D3KooWpeer1"].labels["connection"] == "relay"
        refused = {
            s.labels["reason"]: s.value for s in fams["meshtrain_refused_requests"].samples if s.name.endswith("_total")
        }
        assert refused == {"not-a-member": 3}
        assert fams["meshtrain_parity_minority"].samples[0].value == 1
        code, ctype, page = await trio.to_thread.run_sync(get, srv.url + "/")
        assert code == 200 and ctype.startswith("text/html") and b'id="peers"' in page
        # No CDN, no remote fonts: every src/href is relative or inline.
        assert not re.search(rb'(src|href)\s*=\s*"(https?:)?//', page)
        code, _, body = await trio.to_thread.run_sync(get, srv.url + "/nope")
        assert code == 404 and "error" in json.loads(body)


async def test_stop_needs_the_control_token():
    stopped = []
    async with StatusServer(snapshot, port=0, token="s3cret", on_stop=lambda: stopped.append(1)) as srv:
        for bad in ("", "wrong", "s3cret-and-more"):
            with pytest.raises(StatusError, match="401"):
                await trio.to_thread.run_sync(request_stop, srv.url, bad)
        assert not stopped
        await trio.to_thread.run_sync(request_stop, srv.url, "s3cret")
        assert stopped == [1]
    async with StatusServer(snapshot, port=0, token=None, on_stop=lambda: stopped.append(2)) as srv:
        with pytest.raises(StatusError, match="401"):  # no token configured: nobody may stop it
            await trio.to_thread.run_sync(request_stop, srv.url, "")
    assert stopped == [1]


async def test_export_needs_the_control_token_and_passes_the_path_and_the_refusal_through():
    """`POST /export?out=` (a pipeline swarm's export, node/stages/export.py): the path arrives
    intact (spaces, non-ASCII), the node's answer comes back, and a refusal is its one line."""
    asked: list[str] = []

    def on_export(out: str) -> dict:
        if out.endswith("taken"):
            raise ConfigError(f"{out} exists and is not an empty directory; export into a new one")
        asked.append(out)
        return {"state": "running", "out": out}

    async with StatusServer(snapshot, port=0, token="t", on_export=on_export) as srv:
        with pytest.raises(StatusError, match="401"):
            await trio.to_thread.run_sync(request_export, srv.url, "wrong", "/tmp/x")
        reply = await trio.to_thread.run_sync(request_export, srv.url, "t", "/tmp/my export/é")
        assert reply == {"state": "running", "out": "/tmp/my export/é"} and asked == ["/tmp/my export/é"]
        with pytest.raises(StatusError, match="400 /tmp/taken exists and is not an empty directory"):
            await trio.to_thread.run_sync(request_export, srv.url, "t", "/tmp/taken")
    async with StatusServer(snapshot, port=0, token="t") as srv:  # a node without exports
        with pytest.raises(StatusError, match="400 POST /export"):
            await trio.to_thread.run_sync(request_export, srv.url, "t", "/tmp/x")


def _raw(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        out = b""
        try:  # the server may answer and hang up before it has read everything we send
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            while chunk := s.recv(65536):
                out += chunk
        except OSError:
            pass
        return out


@pytest.mark.parametrize(
    "payload",
    [
        b"\x00\xff garbage \r\n\r\n",
        b"GET /status HTTP/1.1\r\n" + b"X-Big: " + b"a" * 100_000 + b"\r\n\r\n",
        b"GET " + b"/" * 70_000 + b" HTTP/1.1\r\n\r\n",
        b"POST /stop HTTP/1.1\r\nAuthorization: Bearer \xff\xfe\r\nContent-Length: 5\r\n\r\nhello",
        b"BREW /pot HTTP/1.1\r\n\r\n",
        b"",
    ],
)
async def test_hostile_requests_leave_the_server_serving(payload):
    stopped = []
    async with StatusServer(snapshot, port=0, token="t", on_stop=lambda: stopped.append(1)) as srv:
        reply = await trio.to_thread.run_sync(_raw, srv.port, payload)
        # An error status (or, for an unparseable request line, the stdlib's HTTP/0.9-style error
        # page), or a reset when the server hangs up on an oversized request: never a 200.
        assert not reply.startswith(b"HTTP/1.1 2"), reply[:200]
        if payload and reply:
            assert re.match(rb"HTTP/1\.[01] (4\d\d|501)", reply) or b"Error code: 400" in reply, reply[:200]
        # A client that connects and says nothing does not block others.
        idle = socket.create_connection(("127.0.0.1", srv.port))
        try:
            assert (await trio.to_thread.run_sync(fetch_status, srv.url))["training"]["step"] == 10
        finally:
            idle.close()
    assert not stopped


async def test_unreachable_endpoint_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(StatusError, match="cannot reach"):
        await trio.to_thread.run_sync(fetch_status, f"http://127.0.0.1:{port}", 2)


@pytest.mark.parametrize("reply", [b"garbage\r\n\r\n", b"", b"HTTP/1.1 abc\r\n\r\n{}", b"SSH-2.0-OpenSSH_9.6\r\n"])
async def test_a_server_that_is_not_ours_is_a_clear_error(reply):
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()

        def answer_once() -> None:
            conn, _ = srv.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(reply)

        t = threading.Thread(target=answer_once, daemon=True)
        t.start()
        with pytest.raises(StatusError, match="did not answer in HTTP"):
            await trio.to_thread.run_sync(fetch_status, f"http://127.0.0.1:{srv.getsockname()[1]}", 5)
        t.join(5)


async def test_port_in_use_is_an_oserror():
    async with StatusServer(snapshot, port=0) as a:
        with pytest.raises(OSError):
            async with StatusServer(snapshot, port=a.port):
                pass


async def test_status_and_stop_answer_while_the_trio_thread_is_blocked():
    """A training step holding the GIL or a busy event loop must not hold up `node status/stop`:
    the request for a fresh document gives up after FRESH_SNAPSHOT_WAIT and gets the last one;
    the stop is accepted on the server's thread."""
    calls, stopped = [], threading.Event()

    def counting_snapshot() -> dict:
        calls.append(1)
        st = snapshot()
        st["training"]["step"] = len(calls)
        return st

    async with StatusServer(counting_snapshot, port=0, token="t", on_stop=stopped.set) as srv:
        fresh = await trio.to_thread.run_sync(fetch_status, srv.url)
        answers: list = []
        answered = threading.Event()

        def client() -> None:
            answers.append(fetch_status(srv.url, 5))
            request_stop(srv.url, "t", 5)
            answered.set()

        threading.Thread(target=client, daemon=True).start()
        # Block the trio thread (as a stuck event loop would) until the client has its answers.
        answered.wait(20)
        assert answered.is_set() and stopped.is_set(), "status/stop waited for the blocked trio thread"
        assert answers[0] == fresh  # the last document computed, not a fresh one
        with trio.fail_after(5):
            while len(calls) <= fresh["training"]["step"]:  # the queued fresh request now runs ...
                await trio.sleep(0.01)  # sleep: poll interval
        # ... and the next answer is fresh again
        assert (await trio.to_thread.run_sync(fetch_status, srv.url))["training"]["step"] > fresh["training"]["step"]


def test_daemon_file_of_a_dead_or_absent_node_is_a_clear_error(tmp_path):
    with pytest.raises(StatusError, match="no node is running"):
        read_daemon_file(tmp_path)
    (tmp_path / "daemon.json").write_text("{not json")
    with pytest.raises(StatusError, match="cannot read"):
        read_daemon_file(tmp_path)
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    (tmp_path / "daemon.json").write_text(json.dumps({"pid": dead, "status_url": "http://127.0.0.1:1"}))
    with pytest.raises(StatusError, match="not running any more"):
        read_daemon_file(tmp_path)
    (tmp_path / "daemon.json").write_text(json.dumps({"pid": os.getpid(), "status_url": "http://x"}))
    assert read_daemon_file(tmp_path)["status_url"] == "http://x"


async def test_wait_for_exit_returns_once_the_endpoint_is_gone():
    async with StatusServer(snapshot, port=0) as srv:
        url = srv.url
        with pytest.raises(StatusError, match="still running"):
            await trio.to_thread.run_sync(lambda: wait_for_exit(None, url, timeout=0.3))
    assert await trio.to_thread.run_sync(lambda: wait_for_exit(None, url, timeout=5)) < 5


async def test_a_client_that_hangs_up_mid_answer_leaves_no_traceback(capfd):
    """A poller that gives up (its own timeout) while a large answer is being written: the node
    logs nothing of it — socketserver printed a BrokenPipeError traceback into a chaos soak's logs."""
    big = {**snapshot(), "padding": "x" * 8_000_000}

    def hang_up_after_asking(port: int) -> None:
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # close = RST
        s.sendall(b"GET /status HTTP/1.1\r\nHost: x\r\n\r\n")
        s.recv(1024)  # the answer has started
        s.close()

    async with StatusServer(lambda: big, port=0) as srv:
        for _ in range(3):
            await trio.to_thread.run_sync(hang_up_after_asking, srv.port)
        assert (await trio.to_thread.run_sync(fetch_status, srv.url))["training"]["step"] == 10  # still serving
    err = capfd.readouterr().err
    assert "Traceback" not in err and "BrokenPipe" not in err and "ConnectionReset" not in err, err[-2000:]
