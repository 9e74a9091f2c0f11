"""One-off connections: a peer dialled for a query is hung up after it, unless someone keeps it.

Problem. A DHT lookup or store talks to the peers closest to a key, and a stream to a peer we are
not connected to dials it. Every node of a swarm announces itself under the swarm's one key, so
the same few peers near that key are dialled by every node, every announcement: with 13 daemons
bound to 6 connections each, those dials were the bulk of the connections the bound then had to
close (`dht/find`: 229 of the 234 streams that dialled a peer in 5 minutes; docs/benchmarks.md
"Grouped daemons"). Closed by the bound only after its grace (node/bound.py `CLOSE_GRACE_S`),
each held a connection for ~10 s, so a node sat over its bound most of the time, and at hundreds
of daemons the key's holders would hold a connection from everyone.

Design. `OneOffConnections.use(peer)` wraps one query. The first use of a peer we are not
connected to marks the connection it opens as one-off. When the last use of it ends, the
connection lingers `LINGER_S` (a store follows its lookup within milliseconds and reuses it),
then is closed unless:
- `keep(peer)` says otherwise: the node's policy (node/bound.py: a peer its plan wants, one
  whose own plan keeps us, one that is not a live trainer, any in a swarm within the bound); the
  default keeps every connection, so without a policy nothing changes;
- a stream is still open on it after `MAX_LINGERS` lingers (something else — a membership
  exchange, a clock reading — uses it; gossipsub's stream, which every connection carries for its
  life, is no use: `Host.streams_in_use`);
- a use began again (it lingers anew).
A connection that existed when its first use began is never one-off: queries to peers we are
connected to change nothing.

Failures. Closing is best effort (`Host.disconnect` logs a failure at DEBUG); a peer that dials us
back is the caller's bound's business. Cancelling a use (its lookup ended) still releases it. A
policy that raises is logged and the connection kept: a bug there must not take the host down.

Not here: which peers a node wants (node/connections.py `ConnectionPlan`), closing the surplus
over the bound (node/presence.py), the queries themselves (dht/kademlia.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Protocol

import trio

from meshtrain.log import get_logger, kv

log = get_logger(__name__)


class Connections(Protocol):
    """What one-off connections need of the host (transport/host.py `Host`, which holds them)."""

    @property
    def nursery(self) -> trio.Nursery | None: ...
    def is_connected(self, peer: str) -> bool: ...
    def streams_in_use(self, peer: str) -> int: ...
    async def disconnect(self, peer: str) -> None: ...


LINGER_S = 1.0  # a one-off connection outlives its last query this long before it is closed,
MAX_LINGERS = 10  # and lingers again while another stream is open on it, this many times at most


@dataclass
class _Use:
    users: int = 0
    generation: int = 0  # bumped at every use, so a linger that a new use overlapped does nothing


class OneOffConnections:
    """The one-off connections of `host` (module docstring); `closed` counts those hung up."""

    def __init__(self, host: Connections) -> None:
        self.host = host
        self.keep: Callable[[str], bool] = lambda peer: True
        self.closed = 0
        self._uses: dict[str, _Use] = {}  # peer -> its one-off connection's uses (opened by a use)

    def in_use(self) -> int:
        """How many one-off connections are open now (in use or lingering)."""
        return sum(self.host.is_connected(p) for p in self._uses)

    @asynccontextmanager
    async def use(self, peer: str) -> AsyncIterator[None]:
        """One query to `peer`: a connection it opens is one-off (module docstring)."""
        use = self._uses.get(peer)
        if use is None:
            if self.host.is_connected(peer):  # not ours to close
                yield
                return
            use = self._uses[peer] = _Use()
        use.users += 1
        use.generation += 1
        try:
            yield
        finally:
            self._release(peer, use)

    def _release(self, peer: str, use: _Use) -> None:
        use.users -= 1
        nursery = self.host.nursery
        if use.users == 0 and nursery is not None:
            nursery.start_soon(self._linger, peer, use, use.generation)

    async def _linger(self, peer: str, use: _Use, generation: int) -> None:
        for _ in range(MAX_LINGERS):
            await trio.sleep(LINGER_S)
            if use.users or use.generation != generation or self._uses.get(peer) is not use:
                return  # used again meanwhile: its own last use lingers
            if not self.host.is_connected(peer) or not self.host.streams_in_use(peer):
                break  # else something else uses it now: look again a linger later
        del self._uses[peer]
        if not self.host.is_connected(peer) or self.host.streams_in_use(peer):
            return
        try:
            kept = self.keep(peer)
        except Exception:  # a policy's bug must not take the host down: the connection stays
            log.warning(kv("one-off connection policy failed; kept", peer=peer), exc_info=True)
            return
        if not kept:
            self.closed += 1
            log.debug(kv("closing a one-off connection", peer=peer[-8:]))
            await self.host.disconnect(peer)
