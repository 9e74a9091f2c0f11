"""The server half of the node's status endpoint (routes and document: `node/status/client.py`).

The server is the standard library's `ThreadingHTTPServer` on a background thread (a few requests
a second, no dependency to add). Handlers never touch node state from that thread: every request
asks the trio thread for the status document (`trio_token.run_sync_soon`), so the swarm view and
trainer are read where they are written. It is never blocked behind training: a request waits
`FRESH_SNAPSHOT_WAIT` for that answer and otherwise gets the last document computed (its
`node.uptime_s` tells its age), and `POST /stop` calls `on_stop` on the server's own thread, so a
stop is accepted at once however busy the node is. `POST /allow` (the owner's run-time allowlist)
does wait for the trio thread, which writes the config CRDT; `POST /export` too, which starts a
pipeline swarm's export there and answers at once (its progress is in the status document). `/metrics` renders the document with
prometheus-client, one collector per scrape (no state kept between scrapes).

Lifetime: `StatusServer` is a `lifecycle.Service`; leaving it shuts the server down off the trio
thread (a handler may be waiting for a document from that very thread).

Not here: the client (`status.fetch_status`, `request_stop`), which must not import this module.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import json
import threading
from collections.abc import Callable
from contextlib import AsyncExitStack
from http import HTTPStatus
from typing import Any

import trio

from meshtrain.lifecycle import Service
from meshtrain.node.status.client import Snapshot

# How long a request waits for the trio thread to compute a fresh document before it is answered
# with the last one computed (a status page must not hang while the node's event loop is busy).
FRESH_SNAPSHOT_WAIT = 1.0


class _Collector:
    """Prometheus view of one status document per scrape (no state kept between scrapes)."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def collect(self):  # noqa: ANN201 - prometheus-client's collector protocol
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        st = self._snapshot()
        t, n = st["training"], st["node"]
        yield _gauge("meshtrain_step", "inner steps this node has trained", t["step"])
        yield _gauge("meshtrain_round", "outer rounds this node has completed", t["round"])
        yield _gauge("meshtrain_samples_per_second", "training throughput", t["samples_per_s"])
        yield _gauge(
            "meshtrain_skipped_steps", "inner steps skipped to keep the swarm's pace", t.get("skipped_steps", 0)
        )
        yield _gauge("meshtrain_uptime_seconds", "seconds since the node started", n["uptime_s"])
        device = GaugeMetricFamily(
            "meshtrain_device_info", "the device this node trains on (value 1)", labels=["device", "local_ranks"]
        )
        device.add_metric([str(n.get("device", "")), str(n.get("local_ranks", 1))], 1)
        yield device
        for key in ("loss", "eval_loss"):
            if t[key] is not None:
                yield _gauge(f"meshtrain_{key}", f"latest {key.replace('_', ' ')}", t[key])
        for key in ("bytes_sent", "bytes_received"):
            c = CounterMetricFamily(f"meshtrain_{key}", f"outer-optimizer payload {key.replace('_', ' ')}")
            c.add_metric([], t[key])
            yield c
        conns = n.get("connections") or {}
        yield _gauge("meshtrain_connections", "libp2p connections this node holds", conns.get("connections", 0))
        yield _gauge("meshtrain_max_peers", "the connection bound this node keeps to", conns.get("max_peers", 0))
        closed = CounterMetricFamily("meshtrain_connections_closed", "connections closed over the bound since start")
        closed.add_metric([], conns.get("closed", 0))
        yield closed
        one_off = CounterMetricFamily(
            "meshtrain_one_off_connections_closed", "connections a DHT query dialled, hung up after it"
        )
        one_off.add_metric([], conns.get("one_off_closed", 0))
        yield one_off
        yield _gauge("meshtrain_live_peers", "live peers in the swarm view (this node included)", len(st["peers"]))
        steps = GaugeMetricFamily(
            "meshtrain_peer_step", "each live peer's reported step", labels=["peer", "connection", "reachability"]
        )
        for p in st["peers"]:
            steps.add_metric([p["peer_id"], p["connection"], p["reachability"]], p["step"])
        yield steps
        offsets = GaugeMetricFamily(
            "meshtrain_peer_clock_offset_seconds",
            "each live peer's wall clock minus ours, measured (NTP-style; absent until measured)",
            labels=["peer"],
        )
        for p in st["peers"]:
            if p.get("clock_offset_s") is not None:
                offsets.add_metric([p["peer_id"]], p["clock_offset_s"])
        yield offsets
        refused = CounterMetricFamily(
            "meshtrain_refused_requests",
            "requests refused to peers (not-a-member, round-out-of-window, too-many-pending, ...)",
            labels=["reason"],
        )
        for reason, count in sorted((t.get("refused") or {}).items()):
            refused.add_metric([reason], count)
        yield refused
        parity = t.get("parity") or {}
        yield _gauge(
            "meshtrain_parity_minority",
            "1 while this peer's φ differs from the swarm majority's",
            1.0 if parity.get("status") == "minority" else 0.0,
        )
        yield _gauge("meshtrain_parity_resyncs", "re-syncs parity has triggered", parity.get("resyncs", 0))


def _gauge(name: str, doc: str, value: float) -> Any:
    from prometheus_client.core import GaugeMetricFamily

    return GaugeMetricFamily(name, doc, value=value)


class _Handler:
    """The request handler (mixed into `http.server.BaseHTTPRequestHandler` by `_server_class`)."""

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
            from prometheus_client.exposition import CONTENT_TYPE_LATEST

            self._reply_snapshot(lambda st: (CONTENT_TYPE_LATEST, _metrics(st)))
        elif path in ("/", "/index.html"):
            self._send(HTTPStatus.OK, "text/html; charset=utf-8", self.server.dashboard)
        else:
            self._error(HTTPStatus.NOT_FOUND, "no such page; try /, /status or /metrics")

    def do_POST(self) -> None:  # noqa: N802
        path, _, query = self.path.partition("?")
        if path not in ("/stop", "/allow", "/export"):
            self._error(HTTPStatus.NOT_FOUND, "the POSTs are /stop, /allow and /export")
            return
        given = self.headers.get("Authorization", "")
        want = f"Bearer {self.server.token}"
        if not self.server.token or not hmac.compare_digest(given.encode(), want.encode()):
            self._error(HTTPStatus.UNAUTHORIZED, f"POST {path} needs the node's control token")
            return
        if path == "/allow":
            self._allow(query)
            return
        if path == "/export":
            self._export(query)
            return
        # On this thread, not the trio thread: accepting a stop must not wait for a busy event loop.
        self.server.on_stop()
        self._send(HTTPStatus.ACCEPTED, "application/json", b'{"stopping": true}')

    def _allow(self, query: str) -> None:
        from urllib.parse import parse_qs

        from meshtrain.crdt.swarm_view import NotSwarmOwner
        from meshtrain.errors import MeshtrainError

        args = parse_qs(query)
        peer = (args.get("peer") or [""])[0]
        revoke = (args.get("revoke") or ["0"])[0] not in ("", "0")
        if not peer or self.server.on_allow is None:
            self._error(HTTPStatus.BAD_REQUEST, "POST /allow?peer=<peer id>[&revoke=1]")
            return
        try:
            self.server.on_allow(peer, not revoke)  # waits for the trio thread: it writes the config CRDT
        except NotSwarmOwner as e:
            self._error(HTTPStatus.FORBIDDEN, str(e))
            return
        except (MeshtrainError, trio.RunFinishedError) as e:
            self._error(HTTPStatus.BAD_REQUEST, str(e) or "the node is shutting down")
            return
        body = json.dumps({"peer": peer, "allowed": not revoke}).encode()
        self._send(HTTPStatus.OK, "application/json", body)

    def _export(self, query: str) -> None:
        from urllib.parse import parse_qs

        from meshtrain.errors import MeshtrainError

        out = (parse_qs(query).get("out") or [""])[0]
        if not out or self.server.on_export is None:
            self._error(HTTPStatus.BAD_REQUEST, "POST /export?out=<absolute path> (a pipeline swarm's node)")
            return
        try:
            started = self.server.on_export(out)  # waits for the trio thread: the export runs there
        except (MeshtrainError, trio.RunFinishedError) as e:
            self._error(HTTPStatus.BAD_REQUEST, str(e) or "the node is shutting down")
            return
        self._send(HTTPStatus.ACCEPTED, "application/json", json.dumps(started).encode())

    def do_PUT(self) -> None:  # noqa: N802
        self._error(HTTPStatus.METHOD_NOT_ALLOWED, "GET /status, /metrics, /; POST /stop, /allow, /export")

    do_DELETE = do_PATCH = do_PUT  # noqa: N815

    def _reply_snapshot(self, render: Callable[[dict[str, Any]], tuple[str, bytes]]) -> None:
        try:
            st = self.server.current_snapshot()
        except _Unavailable as e:
            self._error(HTTPStatus.SERVICE_UNAVAILABLE, str(e))
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
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(lambda: st))
    return generate_latest(registry)


class _Server:
    """The server (mixed into `http.server.ThreadingHTTPServer` by `_server_class`)."""

    daemon_threads = True
    # Bounded so a client that connects and says nothing cannot pin a thread for ever.
    timeout = 10
    handler_class: type

    def __init__(
        self,
        addr: tuple[str, int],
        *,
        snapshot: Snapshot,
        on_stop: Callable[[], None],
        on_allow: Callable[[str, bool], None] | None,
        on_export: Callable[[str], dict[str, Any]] | None = None,
        token: str | None,
        trio_token: trio.lowlevel.TrioToken,
        dashboard: bytes,
        first: dict[str, Any],
    ) -> None:
        self.snapshot, self.on_stop, self.on_allow, self.token = snapshot, on_stop, on_allow, token
        self.on_export = on_export
        self.trio_token, self.dashboard = trio_token, dashboard
        self._last = first
        self._last_lock = threading.Lock()
        super().__init__(addr, self.handler_class)  # type: ignore[call-arg]

    def finish_request(self, request: Any, client_address: Any) -> None:
        request.settimeout(self.timeout)
        # A client that hung up before its answer was written (a poller's own timeout) is its
        # business, not the node's: socketserver would print a traceback into the node's log.
        with contextlib.suppress(ConnectionError, TimeoutError):
            super().finish_request(request, client_address)  # type: ignore[misc]

    def current_snapshot(self) -> dict[str, Any]:
        """A fresh document from the trio thread if it answers within `FRESH_SNAPSHOT_WAIT`, else
        the last one computed (the first was computed when the server started)."""
        done = threading.Event()
        answer: list[tuple[dict[str, Any] | None, str | None]] = []

        def on_trio() -> None:  # must not raise: an error in a run_sync_soon callback ends the run
            try:
                answer.append((self.snapshot(), None))
            except Exception as e:  # noqa: BLE001 - reported to the client, the node goes on
                answer.append((None, f"the status document failed: {type(e).__name__}: {e}"))
            finally:
                done.set()

        try:
            self.trio_token.run_sync_soon(on_trio)
        except trio.RunFinishedError:
            raise _Unavailable("the node is shutting down") from None
        if not done.wait(FRESH_SNAPSHOT_WAIT):
            with self._last_lock:
                return self._last
        st, error = answer[0]
        if st is None:
            raise _Unavailable(error or "no status document")
        with self._last_lock:
            self._last = st
        return st


class _Unavailable(Exception):
    """No status document can be served now (503)."""


@functools.cache
def _server_class() -> type[_Server]:
    """`_Server` and `_Handler` on the standard library's threading HTTP server, built on first use."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(_Handler, BaseHTTPRequestHandler):
        pass

    class Server(_Server, ThreadingHTTPServer):
        handler_class = Handler

    return Server


class StatusServer(Service):
    """`async with StatusServer(node.snapshot, port=0) as srv: srv.url` — serves until the block ends.

    `snapshot` is called on the trio thread that entered the context; it must be quick (the
    document is served from a cache when the trio thread is busy). `on_stop` is called on the
    server's thread after the token was checked: it must be thread-safe and return at once (the
    reply, 202, says the stop was accepted, not that the node has stopped). `on_allow(peer id,
    allowed)` (None: `POST /allow` is refused) is called on the server's thread after the token
    was checked and may wait for the trio thread; it raises `MeshtrainError` to refuse (400;
    `NotSwarmOwner`: 403). `on_export(out)` (None: `POST /export` is refused) likewise, and
    returns the export's initial progress (202; node/stages/export.py). `port=0` picks a
    free port (`srv.port`). Raises `OSError` if the address cannot be bound.
    """

    def __init__(
        self,
        snapshot: Snapshot,
        *,
        host: str = "127.0.0.1",
        port: int = 7070,
        on_stop: Callable[[], None] | None = None,
        on_allow: Callable[[str, bool], None] | None = None,
        on_export: Callable[[str], dict[str, Any]] | None = None,
        token: str | None = None,
    ) -> None:
        self._snapshot, self._host, self._port = snapshot, host, port
        self._on_stop = on_stop or (lambda: None)
        self._on_allow = on_allow
        self._on_export = on_export
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

    async def _start(self, stack: AsyncExitStack) -> None:
        from importlib import resources

        dashboard = resources.files("meshtrain.node.status").joinpath("dashboard.html").read_bytes()
        server = _server_class()(
            (self._host, self._port),
            snapshot=self._snapshot,
            on_stop=self._on_stop,
            on_allow=self._on_allow,
            on_export=self._on_export,
            token=self._token,
            trio_token=trio.lowlevel.current_trio_token(),
            dashboard=dashboard,
            first=self._snapshot(),
        )
        stack.callback(server.server_close)
        thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="meshtrain-status", daemon=True
        )
        thread.start()
        self._server, self._thread = server, thread

    async def _stop(self) -> None:
        server, thread = self._server, self._thread
        if server is None or thread is None:
            return
        # shutdown() blocks until serve_forever returns; a handler waiting for a snapshot waits
        # for this very trio thread, so run it off-thread and keep the loop turning meanwhile.
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(server.shutdown)
            await trio.to_thread.run_sync(thread.join, 5)
        self._thread = None
