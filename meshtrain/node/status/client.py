"""The node's local status endpoint — its document, routes and client half (the server half is
`node/status/server.py`): JSON status, Prometheus metrics, a dashboard, and stop.

Why an HTTP server at all: `meshtrain node status/stop`, the demo's live table, Prometheus and a
person with a browser all want to ask a running daemon how it is doing without joining the swarm.
It binds to 127.0.0.1 by default; `POST /stop` and `POST /allow` additionally need the bearer token the daemon wrote
to `<data dir>/control.token` (mode 0600), so another local user cannot stop the node or change its allowlist.

The server (`status_server.StatusServer`) runs on a background thread and is never blocked
behind training; see that module.

The client half — `read_daemon_file`, `fetch_status`, `request_stop`, `request_allow`, `request_export` — imports only the standard
library: it is what `meshtrain node status/stop` run, and it must not pay for torch or libp2p.

Routes:
    GET  /            the dashboard (static HTML + inline JS, no external CDN): peers with their
                      reachability and connection type, rounds, loss curve, bandwidth
    GET  /status      the status document (below) as JSON
    GET  /metrics     Prometheus text format (prometheus-client)
    POST /stop        `Authorization: Bearer <token>`; 202 once the node has accepted the request,
                      then it leaves the swarm and checkpoints in the background
    POST /allow?peer=<peer id>[&revoke=1]   the same token; the swarm owner's node admits (or
                      revokes) a peer of an allowlist swarm at run time (node/trust/admission.py): 200
                      once written to the config CRDT; 400 for another admission rule or a bad
                      peer id, 403 from a node that does not own the swarm
    POST /export?out=<absolute path>   the same token; a pipeline swarm's node assembles the
                      whole model from every stage and writes it there (node/stages/export.py):
                      202 once started (progress: `pipeline.export`); 400 if it cannot start

The status document (`Node.snapshot()`):
    node:       peer_id, name, version, started, uptime_s, swarm, state (starting, preparing,
                syncing, training, stopping), state_changes (how many so far), recent_states (the last 8,
                oldest first, ending with state), listen, reachability,
                device ("cpu", "cuda:0 (<GPU name>)"), local_ranks (processes in this peer),
                local_rank_pids (their process ids, by local rank),
                connections: {connections (libp2p connections the host holds), max_peers (the
                bound node/presence.py keeps them to), wanted (how many peers its plan keeps now),
                unwanted (connected but outside the plan: kept for a grace, a syncing member, a
                peer whose round needs us, or because we are under the bound), closed
                (connections closed over the bound since start), one_off_closed (connections a
                DHT query dialled and hung up after it, transport/one_off.py)},
                admission: {rule: open|allowlist|private, not_admitted: why the swarm's peers
                ignore this node (no-proof-of-work, not-on-allowlist, excluded-by-strikes) or
                null, ignored: peer ids whose membership records this node ignores (they fail
                admission — such records are not even stored, and the latest few are listed —
                or strikes exclude them), standing: {peer id: {strikes: rounds counted against
                it, excluded: bool, by_loss / by_spot / by_echo: how many of those rounds loss
                scoring's / spot-checks' / replay screening's strikes counted in}} for every peer
                with verified strikes,
                loss_scoring and spot_check: {scored | checked, skipped} rounds as an owner
                (loss_scoring also waited_s: how long rounds' results waited for it), or
                null when off, other_phi: {passed, filed} loss and spot verdicts on peers that held
                another φ than ours, passed over within `lineage_passes` and filed past them
                (node/trust/strikes.py), or null without strikes}
    training:   step, round, loss, eval_loss, optimizer, samples_per_s, bytes_sent, bytes_received,
                history: [{step, t, loss, eval_loss, ...}] (the last 500 points),
                round_peers: [[round id, [peer id, ...]], ...] who took part in our newest
                exchanges, weight-0 members too (in grouped rounds, our group; 1 peer: we
                proceeded alone),
                phi_round, phi_digest, phi_history, parity ({status: ok|minority|unchecked, ...} or
                null), waiting (what the node waits for now, in words, or null), refused
                ({reason: count}: requests refused to peers, and CRDT records this node would not
                store — crdt-not-admitted, crdt-not-a-member)
    peers:      [{peer_id, addr, connection, data_path, role, in_from, step, loss, last_seen_s,
                clock_offset_s, reachability, strikes}] (and stage: the stage a pipeline swarm's
                peer announces, or null); in_from: the round id (inner step) from which a trainer
                is in the roster of grouped rounds (node/roster.py; 0: from the start);
                last_seen_s: age of its latest heartbeat by our clock; clock_offset_s:
                its wall clock minus ours, measured (node/clock_offsets.py), null until measured
                connection: how *we* reach that peer ("direct", "relayed", "none"; "self");
                data_path: how our newest tensor connection to it went: "direct" (its data
                port, or a hole punched to it) or "libp2p" (the fallback: its data port did not
                answer us — a firewall, a NAT), null before we sent it anything
                reachability: what the peer announces ("public", "relayed": private behind a
                relay reservation, "private", "unknown"; "direct" from a node without NAT
                traversal). node.reachability is ours, in the same terms.
    checkpoint: {last_step, path, saved_at} once one was saved
    joined_from: how a late joiner got its state (donors, bytes, seconds) or null
    pipeline:   only in a pipeline swarm (node/stages/peer.py): mode, stages, stage (ours),
                stage_map ([[peer ids] per stage]: the running epoch's, else as announced),
                stage_cut, replica_sync, activation_codec, device (ours, as `device` above),
                precision, epoch (key or null), epochs,
                forward_s, waiting, joined_from, backup ({stage, step} of the stage with one replica
                we hold a copy of, node/stages/state.py Backups, or null), traffic,
                export (the last `POST /export`'s progress: {state: running|done|failed, out,
                phase, stages: {stage: {done, total}} bytes fetched, result | error}, or null)
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

from meshtrain.durable import write_atomic
from meshtrain.errors import MeshtrainError

# This module is the client of `meshtrain node status/stop`, which must start in tens of
# milliseconds on a machine whose cores are busy training (importing torch and libp2p on that
# path took 6-50 s under load). So the server half lives in `status_server` (it imports trio,
# prometheus-client and the standard library's http.server, ~30 ms of CPU by itself), and the
# client speaks its few lines of HTTP over a socket instead of importing urllib.

Snapshot = Callable[[], dict[str, Any]]

DAEMON_FILE = "daemon.json"
TOKEN_FILE = "control.token"


class StatusError(MeshtrainError):
    """The status endpoint could not be reached or refused the request."""


class StatusUnreachable(StatusError):
    """Nothing answers at the status URL (no node there, or it has exited)."""


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
        raise StatusUnreachable(f"cannot reach the node's status endpoint {url} ({e}); is the node running?") from None
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


def request_allow(url: str, token: str, peer_id: str, *, revoke: bool = False, timeout: float = 10.0) -> None:
    """Ask the swarm owner's node serving `url` to admit `peer_id` (or revoke it) in its
    allowlist swarm (blocking; `StatusError` on failure, with the node's reason)."""
    if not peer_id.isalnum():  # base58: goes into the query string as it is
        raise StatusError(f"{peer_id!r:.70} is not a peer id")
    query = f"peer={peer_id}" + ("&revoke=1" if revoke else "")
    _request(url.rstrip("/") + "/allow?" + query, method="POST", token=token, timeout=timeout)


def request_export(url: str, token: str, out: str, timeout: float = 10.0) -> dict[str, Any]:
    """Ask the pipeline swarm's node serving `url` to export the whole model into `out` (an
    absolute path; node/stages/export.py); its initial progress. `StatusError` with the node's
    reason if it cannot start one."""
    body = _request(url.rstrip("/") + "/export?out=" + quote(out, safe=""), method="POST", token=token, timeout=timeout)
    try:
        reply = json.loads(body)
    except ValueError:
        raise StatusError(f"{url} did not answer the export request in JSON") from None
    return reply if isinstance(reply, dict) else {}


def write_daemon_file(data_dir: Path, info: dict[str, Any]) -> None:
    """daemon.json: how `meshtrain node status/stop` find a running node (`read_daemon_file`)."""
    write_atomic(data_dir / DAEMON_FILE, json.dumps(info).encode())


def read_daemon_file(data_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """What the node running with `data_dir` wrote about itself (`daemon.json`: pid, peer id,
    addresses, status url, token file); `StatusError` if no node runs with this data dir."""
    path = Path(data_dir).expanduser() / DAEMON_FILE
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        raise StatusError(
            f"no node is running with data dir {Path(data_dir).expanduser()} (start one with `meshtrain node start`)"
        ) from None
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
    raise StatusError(
        f"the node is still running {timeout:.0f} s after the stop request; its log says why "
        f"(a round in flight is cancelled after a short grace)"
    )
