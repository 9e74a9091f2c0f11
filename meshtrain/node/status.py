"""The node's local status endpoint: JSON status, Prometheus metrics, a dashboard, and stop.

Why an HTTP server at all: `meshtrain node status/stop`, the demo's live table, Prometheus and a
person with a browser all want to ask a running daemon how it is doing without joining the swarm.
It binds to 127.0.0.1 by default; `POST /stop` additionally needs the bearer token the daemon wrote
to `<data dir>/control.token` (mode 0600), so another local user cannot stop the node.

The server is the standard library's `ThreadingHTTPServer` on a background thread (a few requests
a second, no dependency to add). Handlers never touch node state from that thread: every request
computes the status document on the trio thread through `trio.from_thread`, so the swarm view and
trainer are read where they are written.

Routes:
    GET  /            the dashboard (static HTML + inline JS, no external CDN): peers with their
                      reachability and connection type, rounds, loss curve, bandwidth
    GET  /status      the status document (below) as JSON
    GET  /metrics     Prometheus text format (prometheus-client)
    POST /stop        `Authorization: Bearer <token>`; the node leaves the swarm and checkpoints

The status document (`Node.snapshot()`):
    node:       peer_id, name, version, started, uptime_s, swarm, state, listen, reachability,
                device ("cpu", "cuda:0 (<GPU name>)"), local_ranks (processes in this peer),
                local_rank_pids (their process ids, by local rank)
    training:   step, round, loss, eval_loss, optimizer, samples_per_s, bytes_sent, bytes_received,
                history: [{step, t, loss, eval_loss, ...}] (the last 500 points)
    peers:      [{peer_id, addr, connection, role, step, loss, last_seen_s, reachability}]
                connection: how *we* reach that peer ("direct", "relayed", "none"; "self");
                reachability: what the peer announces ("public", "relayed": private behind a
                relay reservation, "private", "unknown"; "direct" from a node without NAT
                traversal). node.reachability is ours, in the same terms.
    checkpoint: {last_step, path, saved_at} once one was saved
    joined_from: how a late joiner got its state (donors, bytes, seconds) or null
"""

from __future__ import annotations

import contextlib
import hmac
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any

import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from meshtrain.errors import MeshtrainError

Snapshot = Callable[[], dict[str, Any]]


class StatusError(MeshtrainError):
    """The status endpoint could not be reached or refused the request."""


class _Collector:
    """Prometheus view of one status document per scrape (no state kept between scrapes)."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def collect(self):  # noqa: ANN201 - prometheus-client's collector protocol
        st = self._snapshot()
        t, n = st["training"], st["node"]
        yield _gauge("meshtrain_step", "inner steps this node has trained", t["step"])
        yield _gauge("meshtrain_round", "outer rounds this node has completed", t["round"])
        yield _gauge("meshtrain_samples_per_second", "training throughput", t["samples_per_s"])
        yield _gauge("meshtrain_uptime_seconds", "seconds since the node started", n["uptime_s"])
        device = GaugeMetricFamily("meshtrain_device_info", "the device this node trains on (value 1)",
                                   labels=["device", "local_ranks"])
        device.add_metric([str(n.get("device", "")), str(n.get("local_ranks", 1))], 1)
        yield device
        for key in ("loss", "eval_loss"):
            if t[key] is not None:
                yield _gauge(f"meshtrain_{key}", f"latest {key.replace('_', ' ')}", t[key])
        for key in ("bytes_sent", "bytes_received"):
            c = CounterMetricFamily(f"meshtrain_{key}", f"outer-optimizer payload {key.replace('_', ' ')}")
            c.add_metric([], t[key])
            yield c
        yield _gauge("meshtrain_live_peers", "live peers in the swarm view (this node included)", len(st["peers"]))
        steps = GaugeMetricFamily("meshtrain_peer_step", "each live peer's reported step",
                                  labels=["peer", "connection", "reachability"])
        for p in st["peers"]:
            steps.add_metric([p["peer_id"], p["connection"], p["reachability"]], p["step"])
        yield steps


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "meshtrain"
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass  # quiet by default, like the rest of meshtrain's logs

    def do_GET(self) -> None:  # noqa: N802 - stdlib naming
        path = self.path.split("?", 1)[0]
        if path == "/status":
            self._reply_snapshot(lambda st: ("application/json", json.dumps(st).encode()))
        elif path == "/metrics":
            self._reply_snapshot(lambda st: (CONTENT_TYPE_LATEST, _metrics(st)))
        elif path in ("/", "/index.html"):
            self._send(HTTPStatus.OK, "text/html; charset=utf-8", self.server.dashboard)
        else:
            self._error(HTTPStatus.NOT_FOUND, "no such page; try /, /status or /metrics")

    def do_POST(self) -> None:  # noqa: N802
        if self.path.split("?", 1)[0] != "/stop":
            self._error(HTTPStatus.NOT_FOUND, "the only POST is /stop")
            return
        given = self.headers.get("Authorization", "")
        want = f"Bearer {self.server.token}"
        if not self.server.token or not hmac.compare_digest(given.encode(), want.encode()):
            self._error(HTTPStatus.UNAUTHORIZED, "POST /stop needs the node's control token")
            return
        with contextlib.suppress(trio.RunFinishedError):  # already stopping: what the caller asked for
            trio.from_thread.run_sync(self.server.on_stop, trio_token=self.server.trio_token)
        self._send(HTTPStatus.ACCEPTED, "application/json", b'{"stopping": true}')

    def do_PUT(self) -> None:  # noqa: N802
        self._error(HTTPStatus.METHOD_NOT_ALLOWED, "GET /status, /metrics, /; POST /stop")

    do_DELETE = do_PATCH = do_PUT  # noqa: N815

    def _reply_snapshot(self, render: Callable[[dict[str, Any]], tuple[str, bytes]]) -> None:
        try:
            st = trio.from_thread.run_sync(self.server.snapshot, trio_token=self.server.trio_token)
        except trio.RunFinishedError:
            self._error(HTTPStatus.SERVICE_UNAVAILABLE, "the node is shutting down")
            return
        ctype, body = render(st)
        self._send(HTTPStatus.OK, ctype, body)

    def _error(self, status: HTTPStatus, message: str) -> None:
        self._send(status, "application/json", json.dumps({"error": message}).encode())

    def _send(self, status: HTTPStatus, ctype: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


def _metrics(st: dict[str, Any]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(lambda: st))
    return generate_latest(registry)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # Bounded so a client that connects and says nothing cannot pin a thread for ever.
    timeout = 10

    def __init__(self, addr: tuple[str, int], *, snapshot: Snapshot, on_stop: Callable[[], None],
                 token: str | None, trio_token: trio.lowlevel.TrioToken, dashboard: bytes) -> None:
        self.snapshot, self.on_stop, self.token = snapshot, on_stop, token
        self.trio_token, self.dashboard = trio_token, dashboard
        super().__init__(addr, _Handler)

    def finish_request(self, request: Any, client_address: Any) -> None:
        request.settimeout(self.timeout)
        super().finish_request(request, client_address)


class StatusServer:
    """`async with StatusServer(node.snapshot, port=0) as srv: srv.url` — serves until the block ends.

    `snapshot` and `on_stop` are called on the trio thread that entered the context. `port=0`
    picks a free port (`srv.port`). Raises `OSError` if the address cannot be bound.
    """

    def __init__(self, snapshot: Snapshot, *, host: str = "127.0.0.1", port: int = 7070,
                 on_stop: Callable[[], None] | None = None, token: str | None = None) -> None:
        self._snapshot, self._host, self._port = snapshot, host, port
        self._on_stop = on_stop or (lambda: None)
        self._token = token
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        assert self._server is not None, "the status server is not running"
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        host = self._host if self._host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    async def __aenter__(self) -> StatusServer:
        dashboard = resources.files("meshtrain.node").joinpath("dashboard.html").read_bytes()
        self._server = _Server((self._host, self._port), snapshot=self._snapshot, on_stop=self._on_stop,
                               token=self._token, trio_token=trio.lowlevel.current_trio_token(),
                               dashboard=dashboard)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="meshtrain-status", daemon=True)
        self._thread.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        server, thread = self._server, self._thread
        if server is None or thread is None:
            return
        # shutdown() blocks until serve_forever returns; a handler blocked in from_thread would wait
        # for this very trio thread, so run it off-thread and keep the loop turning meanwhile.
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(server.shutdown)
            await trio.to_thread.run_sync(thread.join, 5)
        server.server_close()
        self._server = self._thread = None


def _request(url: str, *, method: str = "GET", token: str | None = None, timeout: float) -> bytes:
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - our own local URL
            return resp.read()
    except urllib.error.HTTPError as e:
        try:
            detail = json.loads(e.read()).get("error", e.reason)
        except (ValueError, AttributeError, OSError):
            detail = e.reason
        raise StatusError(f"{url}: {e.code} {detail}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise StatusError(f"cannot reach the node's status endpoint {url} ({reason}); is the node running?") from None


def fetch_status(url: str, timeout: float = 5.0) -> dict[str, Any]:
    """The status document of the node serving `url` (blocking; `StatusError` on failure)."""
    body = _request(url.rstrip("/") + "/status", timeout=timeout)
    try:
        st = json.loads(body)
    except ValueError:
        raise StatusError(f"{url} did not answer with a status document") from None
    if not isinstance(st, dict) or not {"node", "training", "peers"} <= st.keys():
        raise StatusError(f"{url} did not answer with a status document")
    return st


def request_stop(url: str, token: str, timeout: float = 5.0) -> None:
    """Ask the node serving `url` to stop cleanly (blocking; `StatusError` on failure)."""
    _request(url.rstrip("/") + "/stop", method="POST", token=token, timeout=timeout)
