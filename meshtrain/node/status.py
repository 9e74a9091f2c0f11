"""The node's local status endpoint: JSON status, Prometheus metrics, a dashboard, and stop.

Why an HTTP server at all: `meshtrain node status/stop`, the demo's live table, Prometheus and a
person with a browser all want to ask a running daemon how it is doing without joining the swarm.
It binds to 127.0.0.1 by default; `POST /stop` additionally needs the bearer token the daemon wrote
to `<data dir>/control.token` (mode 0600), so another local user cannot stop the node.

The server is the standard library's `ThreadingHTTPServer` on a background thread (a few requests
a second, no dependency to add). Handlers never touch node state from that thread: every request
asks the trio thread for the status document (`trio_token.run_sync_soon`), so the swarm view and
trainer are read where they are written. It is never blocked behind training: a request waits
`FRESH_SNAPSHOT_WAIT` for that answer and otherwise gets the last document computed (its
`node.uptime_s` tells its age), and `POST /stop` calls `on_stop` on the server's own thread, so a
stop is accepted at once however busy the node is.

The client half — `read_daemon_file`, `fetch_status`, `request_stop` — imports only the standard
library: it is what `meshtrain node status/stop` run, and it must not pay for torch or libp2p.

Routes:
    GET  /            the dashboard (static HTML + inline JS, no external CDN): peers with their
                      reachability and connection type, rounds, loss curve, bandwidth
    GET  /status      the status document (below) as JSON
    GET  /metrics     Prometheus text format (prometheus-client)
    POST /stop        `Authorization: Bearer <token>`; 202 once the node has accepted the request,
                      then it leaves the swarm and checkpoints in the background

The status document (`Node.snapshot()`):
    node:       peer_id, name, version, started, uptime_s, swarm, state (starting, syncing,
                training, stopping), state_changes (how many so far), recent_states (the last 8,
                oldest first, ending with state), listen, reachability,
                device ("cpu", "cuda:0 (<GPU name>)"), local_ranks (processes in this peer),
                local_rank_pids (their process ids, by local rank)
    training:   step, round, loss, eval_loss, optimizer, samples_per_s, bytes_sent, bytes_received,
                history: [{step, t, loss, eval_loss, ...}] (the last 500 points),
                phi_round, phi_digest, phi_history, parity ({status: ok|minority|unchecked, ...} or
                null), waiting (what the node waits for now, in words, or null)
    peers:      [{peer_id, addr, connection, role, step, loss, last_seen_s, reachability}]
                connection: how *we* reach that peer ("direct", "relayed", "none"; "self");
                reachability: what the peer announces ("public", "relayed": private behind a
                relay reservation, "private", "unknown"; "direct" from a node without NAT
                traversal). node.reachability is ours, in the same terms.
    checkpoint: {last_step, path, saved_at} once one was saved
    joined_from: how a late joiner got its state (donors, bytes, seconds) or null
"""

from __future__ import annotations

import functools
import hmac
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from meshtrain.errors import MeshtrainError

if TYPE_CHECKING:
    import trio

# This module is also the client of `meshtrain node status/stop`, which must start in tens of
# milliseconds on a machine whose cores are busy training (importing torch and libp2p on that
# path took 6-50 s under load). So the server half imports trio, prometheus-client and the
# standard library's http.server (~30 ms of CPU by itself) only when a server starts, and the
# client speaks its few lines of HTTP over a socket instead of importing urllib.

Snapshot = Callable[[], dict[str, Any]]

DAEMON_FILE = "daemon.json"
TOKEN_FILE = "control.token"
# How long a request waits for the trio thread to compute a fresh document before it is answered
# with the last one computed (a status page must not hang while the node's event loop is busy).
FRESH_SNAPSHOT_WAIT = 1.0


class StatusError(MeshtrainError):
    """The status endpoint could not be reached or refused the request."""


class StatusUnreachable(StatusError):
    """Nothing answers at the status URL (no node there, or it has exited)."""


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
        refused = CounterMetricFamily("meshtrain_refused_requests", "requests refused to peers (not-a-member, "
                                      "round-out-of-window, too-many-pending, ...)", labels=["reason"])
        for reason, count in sorted((t.get("refused") or {}).items()):
            refused.add_metric([reason], count)
        yield refused
        parity = t.get("parity") or {}
        yield _gauge("meshtrain_parity_minority", "1 while this peer's φ differs from the swarm majority's",
                     1.0 if parity.get("status") == "minority" else 0.0)
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
        if self.path.split("?", 1)[0] != "/stop":
            self._error(HTTPStatus.NOT_FOUND, "the only POST is /stop")
            return
        given = self.headers.get("Authorization", "")
        want = f"Bearer {self.server.token}"
        if not self.server.token or not hmac.compare_digest(given.encode(), want.encode()):
            self._error(HTTPStatus.UNAUTHORIZED, "POST /stop needs the node's control token")
            return
        # On this thread, not the trio thread: accepting a stop must not wait for a busy event loop.
        self.server.on_stop()
        self._send(HTTPStatus.ACCEPTED, "application/json", b'{"stopping": true}')

    def do_PUT(self) -> None:  # noqa: N802
        self._error(HTTPStatus.METHOD_NOT_ALLOWED, "GET /status, /metrics, /; POST /stop")

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

    def __init__(self, addr: tuple[str, int], *, snapshot: Snapshot, on_stop: Callable[[], None],
                 token: str | None, trio_token: trio.lowlevel.TrioToken, dashboard: bytes,
                 first: dict[str, Any]) -> None:
        self.snapshot, self.on_stop, self.token = snapshot, on_stop, token
        self.trio_token, self.dashboard = trio_token, dashboard
        self._last = first
        self._last_lock = threading.Lock()
        super().__init__(addr, self.handler_class)  # type: ignore[call-arg]

    def finish_request(self, request: Any, client_address: Any) -> None:
        request.settimeout(self.timeout)
        super().finish_request(request, client_address)  # type: ignore[misc]

    def current_snapshot(self) -> dict[str, Any]:
        """A fresh document from the trio thread if it answers within `FRESH_SNAPSHOT_WAIT`, else
        the last one computed (the first was computed when the server started)."""
        import trio

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


class StatusServer:
    """`async with StatusServer(node.snapshot, port=0) as srv: srv.url` — serves until the block ends.

    `snapshot` is called on the trio thread that entered the context; it must be quick (the
    document is served from a cache when the trio thread is busy). `on_stop` is called on the
    server's thread after the token was checked: it must be thread-safe and return at once (the
    reply, 202, says the stop was accepted, not that the node has stopped). `port=0` picks a
    free port (`srv.port`). Raises `OSError` if the address cannot be bound.
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
        from importlib import resources

        import trio

        dashboard = resources.files("meshtrain.node").joinpath("dashboard.html").read_bytes()
        self._server = _server_class()(
            (self._host, self._port), snapshot=self._snapshot, on_stop=self._on_stop, token=self._token,
            trio_token=trio.lowlevel.current_trio_token(), dashboard=dashboard, first=self._snapshot())
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="meshtrain-status", daemon=True)
        self._thread.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        import trio

        server, thread = self._server, self._thread
        if server is None or thread is None:
            return
        # shutdown() blocks until serve_forever returns; a handler waiting for a snapshot waits
        # for this very trio thread, so run it off-thread and keep the loop turning meanwhile.
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(server.shutdown)
            await trio.to_thread.run_sync(thread.join, 5)
        server.server_close()
        self._server = self._thread = None


MAX_REPLY = 64 * 2**20  # bytes a client reads at most (a status document is ~100 KiB)


def _request(url: str, *, method: str = "GET", token: str | None = None, timeout: float) -> bytes:
    """One request to a node's status server; the body of its 2xx reply, else `StatusError`.

    It speaks only the HTTP/1.1 our server does — one request per connection, which the server
    closes after a reply with a Content-Length — so that `node status/stop` need not import
    urllib and http.client (more CPU than the whole request on a busy machine)."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise StatusError(f"{url} is not a status URL (http://host:port)")
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    head = [f"{method} {target} HTTP/1.1", f"Host: {parts.netloc}", "Connection: close", "Content-Length: 0"]
    if token is not None:
        head.append(f"Authorization: Bearer {token}")
    try:
        with socket.create_connection((parts.hostname, parts.port or 80), timeout=timeout) as sock:
            sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
            raw = bytearray()
            while chunk := sock.recv(1 << 16):
                raw += chunk
                if len(raw) > MAX_REPLY:
                    raise StatusError(f"{url} answered with more than {MAX_REPLY >> 20} MiB")
    except OSError as e:
        raise StatusUnreachable(f"cannot reach the node's status endpoint {url} ({e}); "
                                f"is the node running?") from None
    code, reason, body = _parse_reply(bytes(raw), url)
    if not 200 <= code < 300:
        try:
            detail = json.loads(body).get("error") or reason
        except (ValueError, AttributeError):
            detail = reason
        raise StatusError(f"{url}: {code} {detail}")
    return body


def _parse_reply(raw: bytes, url: str) -> tuple[int, str, bytes]:
    """(status code, reason, body) of one HTTP/1.x reply read to the end of the connection."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = lines[0].split(None, 2)
    if not sep or len(status) < 2 or not status[0].startswith(b"HTTP/1.") or not status[1].isdigit():
        raise StatusError(f"{url} did not answer in HTTP; is it a meshtrain status URL?")
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length" and value.strip().isdigit():
            body = body[: int(value)]
    return int(status[1]), status[2].decode("latin-1") if len(status) > 2 else "", body


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


def read_daemon_file(data_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """What the node running with `data_dir` wrote about itself (`daemon.json`: pid, peer id,
    addresses, status url, token file); `StatusError` if no node runs with this data dir."""
    path = Path(data_dir).expanduser() / DAEMON_FILE
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        raise StatusError(f"no node is running with data dir {Path(data_dir).expanduser()} "
                          f"(start one with `meshtrain node start`)") from None
    except (OSError, ValueError) as e:
        raise StatusError(f"cannot read {path}: {e}") from None
    if not isinstance(info, dict):
        raise StatusError(f"cannot read {path}: not a JSON object")
    if not pid_alive(info.get("pid")):
        raise StatusError(f"the node that wrote {path} (pid {info.get('pid')}) is not running any more")
    return info


def pid_alive(pid: Any) -> bool:
    """Whether process `pid` runs (True when it cannot be told: another user's, or no pid). A
    zombie — exited, not yet reaped by its parent (a test, a supervisor) — does not run."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return True
    try:  # Linux: the state is the field after the command name, which may contain spaces
        return Path(f"/proc/{int(pid)}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def wait_for_exit(pid: int | None, url: str, timeout: float, poll: float = 0.1) -> float:
    """Block until the node (process `pid`, or — without one — its status endpoint) is gone;
    the seconds waited. `StatusError` after `timeout` seconds."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pid is not None:
            if not pid_alive(pid):
                return time.monotonic() - t0
        else:
            try:
                _request(url.rstrip("/") + "/status", timeout=min(2.0, timeout))
            except StatusUnreachable:
                return time.monotonic() - t0
            except StatusError:
                pass  # 503 while it shuts down: still there
        time.sleep(poll)
    raise StatusError(f"the node is still running {timeout:.0f} s after the stop request; its log says why "
                      f"(a round in flight is cancelled after a short grace)")
