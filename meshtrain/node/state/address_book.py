"""The address book: the swarm's trainers this node has seen, kept across restarts, so that a node
that resumes its checkpoint finds its swarm again even when the bootstrap address it was given
is dead.

Problem. A restarted node knows its swarm (its checkpoint, the signed spec), but its CRDT replica
of membership lives in memory and is gone. Before this module, its only ways back were the
`--bootstrap` list and the peer it joined through. In a soak of 5 daemons where each restart was
given one random member's address, two restarted nodes found that one address dead, logged "no
bootstrap peer reachable; running alone until peers dial us" and committed rounds alone for up
to 30 s — a fork of the swarm (held-out loss 1.57–1.60 against the swarm's 1.49–1.52) that
nothing could repair until someone happened to dial them.

Design. `AddressBook` is a file, `peers.json` in the data dir: for each other trainer of the
swarm that the node saw live, its addresses and when we last saw it live (our own wall clock,
milliseconds: it compares only with itself, across our own restarts). `PeerPresence` notes the
view's live trainers every pass of its re-dial loop and saves the book when it changed (at most
every `SAVE_INTERVAL` seconds, with `write_atomic`, and on leaving); a peer that left the swarm
cleanly (its tombstone) is dropped. On the next start `fresh(horizon)` answers which of them
were seen recently enough to be probably still there: presence adds their addresses to the
DHT's bootstrap list and re-dials them with backoff until one answers, and the run state does
not train (so commits no round) alone while such peers are known and none is reached
(`PeerPresence.cut_off`, `RunState.enter`).

File: `{"swarm": <swarm id>, "peers": {<peer id>: {"addrs": [...], "seen_ms": <int>}}}`. A book
of another swarm (a data dir reused), or one that does not parse, is ignored (logged) and
rewritten. At most `MAX_PEERS` entries are kept, the most recently seen.

Not here: dialling (`node/presence.py`), who is live now (the CRDT view), the wait itself
(`node/state/run_state.py`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from meshtrain.crdt.swarm_view import PeerInfo
from meshtrain.crdt.types import now_ms
from meshtrain.durable import write_atomic
from meshtrain.log import get_logger, kv
from meshtrain.transport.host import dialable_addrs

log = get_logger(__name__)

BOOK_FILE = "peers.json"
MAX_PEERS = 256  # the most recently seen are kept: enough to find a swarm again, bounded on disk
SAVE_INTERVAL = 5.0  # seconds: the book is written at most this often while it changes
SEEN_GRAIN_MS = 30_000  # a peer's "last seen" is rewritten only when it moved this much


@dataclass(frozen=True)
class KnownPeer:
    """A trainer of the swarm we saw live: where it listened, and when (our clock, ms)."""

    peer_id: str
    addrs: tuple[str, ...]
    seen_ms: int

    def dial_addrs(self) -> list[str]:
        """Its addresses another machine can dial, with `/p2p/<id>` (transport/host.py)."""
        return dialable_addrs(self.addrs, self.peer_id)


class AddressBook:
    """The trainers of swarm `swarm_id` this node saw, in `data_dir/peers.json` (module docstring).
    `data_dir` None: kept in memory only (a node without a data dir of its own)."""

    def __init__(self, data_dir: Path | None, swarm_id: str, me: str) -> None:
        self.path = data_dir / BOOK_FILE if data_dir is not None else None
        self.swarm_id = swarm_id
        self.me = me
        self.peers: dict[str, KnownPeer] = {}
        self._dirty = False
        self._saved_at = 0.0

    def load(self) -> None:
        """Read the book of an earlier life; a missing, unreadable or foreign one is ignored."""
        if self.path is None or not self.path.exists():
            return
        try:
            doc = json.loads(self.path.read_text())
            if doc.get("swarm") != self.swarm_id:
                log.info(kv("address book is of another swarm; starting a new one", path=str(self.path)))
                return
            for peer, entry in doc["peers"].items():
                addrs = tuple(str(a) for a in entry["addrs"])
                if peer != self.me and addrs:
                    self.peers[str(peer)] = KnownPeer(str(peer), addrs, int(entry["seen_ms"]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning(kv("address book unreadable; starting a new one", path=str(self.path), error=str(e)))
            self.peers.clear()

    def note(self, live: Iterable[PeerInfo], *, left: Iterable[str] = (), at_ms: int | None = None) -> None:
        """Take in the view: its `live` trainers are noted as seen now, peers that `left` the
        swarm cleanly are forgotten."""
        now = now_ms() if at_ms is None else at_ms
        for peer in left:
            self._dirty |= self.peers.pop(peer, None) is not None
        for p in live:
            if p.peer_id == self.me or p.role != "trainer" or not p.addrs:
                continue
            old = self.peers.get(p.peer_id)
            self.peers[p.peer_id] = KnownPeer(p.peer_id, tuple(p.addrs), now)
            self._dirty |= old is None or old.addrs != tuple(p.addrs) or now - old.seen_ms >= SEEN_GRAIN_MS
        if len(self.peers) > MAX_PEERS:
            keep = sorted(self.peers.values(), key=lambda k: k.seen_ms, reverse=True)[:MAX_PEERS]
            self.peers = {k.peer_id: k for k in keep}

    def fresh(self, horizon_s: float, *, at_ms: int | None = None) -> list[KnownPeer]:
        """The peers seen live within the last `horizon_s` seconds, most recent first."""
        now = now_ms() if at_ms is None else at_ms
        out = [k for k in self.peers.values() if now - k.seen_ms <= horizon_s * 1000]
        return sorted(out, key=lambda k: k.seen_ms, reverse=True)

    def save(self, *, force: bool = False) -> None:
        """Write the book if it changed (and `SAVE_INTERVAL` passed since the last write, unless
        `force`). A failed write is logged: the book is a hint, never worth stopping a node for."""
        if self.path is None or not self._dirty:
            return
        if not force and time.monotonic() - self._saved_at < SAVE_INTERVAL:
            return
        doc = {
            "swarm": self.swarm_id,
            "peers": {k.peer_id: {"addrs": list(k.addrs), "seen_ms": k.seen_ms} for k in self.peers.values()},
        }
        try:
            write_atomic(self.path, json.dumps(doc, indent=1).encode())
            self._dirty = False
            self._saved_at = time.monotonic()
        except OSError as e:
            log.warning(kv("address book not saved", path=str(self.path), error=str(e)))
