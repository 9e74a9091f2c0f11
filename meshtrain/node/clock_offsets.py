"""Clock offsets: how far each peer's wall clock is from ours — measured and shown, never trusted.

Problem. Peers' wall clocks drift: a home machine without NTP, a VM resumed from a suspend. The
swarm no longer depends on them — liveness is judged on each reader's monotonic clock
(crdt/swarm_records.py, `Freshness`) and signed records tolerate `CLOCK_SKEW_S` (clock.py) — but
an operator still needs to see a skewed peer (its log lines and checkpoint times disagree with
everyone's, its DHT records expire early or late), and nothing said so before.

Design. NTP's exchange (RFC 5905, section 8), once per peer every `SAMPLE_INTERVAL` seconds: we
note our wall clock t0, ask the peer for its wall clock, which it reads once as it answers
(t1 = t2), and note t3 when the answer is back; the offset (its clock minus ours) is
θ = ((t1 − t0) + (t2 − t3)) / 2, wrong by at most half the round trip. t3 is t0 plus the round
trip measured on our monotonic clock, so a step of our own wall clock mid-exchange does not
count. A peer's estimate is the sample with the shortest round trip among its last
`KEEP_SAMPLES` (NTP's clock filter: the shortest round trip bounds the error best, and a
congested exchange is passed over). The exchange is its own one-round-trip RPC: no RPC of the
daemon already visits every peer (anti-entropy talks to one random peer at a time). The live
members we are connected to are sampled, at most `MAX_CONCURRENT` at once; estimates of peers
that are no longer live or connected are dropped.

An offset beyond `WARN_OFFSET_S` is logged once per peer at WARNING, naming the peer and the
offset. The node's status document shows each peer's `clock_offset_s` (`meshtrain node status`,
/status, /metrics' `meshtrain_peer_clock_offset_seconds`).

Wire: `clock/now` {} -> {"t": float, our wall clock in seconds since the epoch}.

Failures. A peer that does not answer within `SAMPLE_TIMEOUT`, or answers something that is not
a finite time, gives no sample (logged at DEBUG); its earlier estimate stands while it is live
and connected. A peer may lie about its clock: the offset is shown, never acted on.

Not here: liveness (crdt/), the skew tolerance of signed records (clock.py), choosing whom we are
connected to (node/presence.py).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import trio

from meshtrain.lifecycle import Service
from meshtrain.log import get_logger, kv
from meshtrain.transport.host import Host
from meshtrain.transport.rpc import RpcError
from meshtrain.transport.validate import MALFORMED, Malformed, is_number

log = get_logger(__name__)

RPC_CLOCK = "clock/now"
SAMPLE_INTERVAL = 10.0  # seconds between two exchanges with one peer
SAMPLE_TIMEOUT = 5.0  # seconds an exchange may take
KEEP_SAMPLES = 8  # a peer's estimate: the shortest round trip among this many latest samples
MAX_CONCURRENT = 8  # exchanges in flight at once
WARN_OFFSET_S = 5.0  # an offset beyond this is logged, once per peer


@dataclass(frozen=True)
class OffsetSample:
    """One exchange: the peer's clock minus ours (`offset_s`), and the round trip that bounds its
    error (±`rtt_s` / 2)."""

    offset_s: float
    rtt_s: float


def offset_from_exchange(t0: float, t1: float, t2: float, t3: float) -> OffsetSample:
    """NTP's offset and round trip from the four timestamps: t0 and t3 ours (request sent, answer
    received), t1 and t2 the peer's (request received, answer sent)."""
    return OffsetSample(((t1 - t0) + (t2 - t3)) / 2, (t3 - t0) - (t2 - t1))


class ClockOffsets(Service):
    """`async with ClockOffsets(host, peers) as offsets:` — serves `clock/now` and keeps an
    offset estimate for every peer `peers()` names (the live members we are connected to).

    host: the libp2p host (its RPC layer serves and calls). peers: who to sample now.
    interval: seconds between two exchanges with one peer.
    """

    def __init__(self, host: Host, peers: Callable[[], list[str]], *, interval: float = SAMPLE_INTERVAL) -> None:
        self.host = host
        self.peers = peers
        self.interval = interval
        self._samples: dict[str, deque[OffsetSample]] = {}
        self._next: dict[str, float] = {}  # peer -> monotonic time of its next exchange
        self._warned: set[str] = set()

    async def _start(self, stack: AsyncExitStack) -> None:
        self.host.rpc.serve(RPC_CLOCK, self._serve)
        self._nursery = await stack.enter_async_context(trio.open_nursery())
        self._nursery.start_soon(self._sample_forever)

    async def _serve(self, _peer: str, request: Any) -> dict[str, float]:
        if request != {}:
            raise Malformed(f"{RPC_CLOCK} takes an empty map")
        return {"t": time.time()}

    def offsets(self) -> dict[str, OffsetSample]:
        """peer -> its estimate (the shortest round trip among its latest samples)."""
        return {p: min(s, key=lambda x: x.rtt_s) for p, s in self._samples.items() if s}

    def offset(self, peer: str) -> float | None:
        """The peer's clock minus ours, in seconds (None: not measured yet)."""
        best = self.offsets().get(peer)
        return None if best is None else best.offset_s

    async def sample(self, peer: str) -> OffsetSample | None:
        """One exchange with `peer`, kept in its estimate (None: no answer, or a malformed one)."""
        t0, m0 = time.time(), time.monotonic()
        try:
            reply = await self.host.rpc.call(peer, RPC_CLOCK, {}, timeout=SAMPLE_TIMEOUT)
        except RpcError as e:
            log.debug(kv("clock exchange failed", peer=peer, error=str(e)))
            return None
        rtt = time.monotonic() - m0
        t = reply.get("t") if isinstance(reply, dict) else None
        if not is_number(t) or not math.isfinite(t):
            log.debug(kv("clock exchange failed", peer=peer, error=MALFORMED))
            return None
        got = offset_from_exchange(t0, t, t, t0 + rtt)
        self._samples.setdefault(peer, deque(maxlen=KEEP_SAMPLES)).append(got)
        best = self.offset(peer)
        if best is not None and abs(best) > WARN_OFFSET_S and peer not in self._warned:
            self._warned.add(peer)
            log.warning(
                kv(
                    "peer clock is off ours; the swarm does not depend on it, but fix its time (NTP)",
                    peer=peer,
                    offset_s=round(best, 1),
                )
            )
        return got

    async def _sample_forever(self) -> None:
        limit = trio.CapacityLimiter(MAX_CONCURRENT)

        async def one(peer: str) -> None:
            async with limit:
                await self.sample(peer)

        while True:
            peers = set(self.peers())
            for gone in (set(self._samples) | set(self._next)) - peers:
                self._samples.pop(gone, None)
                self._next.pop(gone, None)
            now = time.monotonic()
            due = [p for p in peers if now >= self._next.get(p, 0.0)]
            for p in due:
                self._next[p] = now + self.interval
            if due:
                async with trio.open_nursery() as nursery:
                    for p in due:
                        nursery.start_soon(one, p)
            await trio.sleep(min(1.0, self.interval))
