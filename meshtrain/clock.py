"""`CLOCK_SKEW_S`: how far apart two peers' wall clocks may be before a signed record is refused.

Peers do not share a clock. Home machines without NTP and VMs resumed from a suspend drift by
minutes, so every check that compares a time another peer signed (a DHT record's expiry, dht/
records.py) with our own clock tolerates this much either way — as Kademlia's record stores and
TLS certificate checks tolerate a few minutes of skew. Five minutes is the figure both use.

Liveness does not use wall clocks at all: a peer is live while *our* monotonic clock has seen a
newer heartbeat of it within its lease (crdt/swarm_records.py, `Freshness`), and each peer's
offset from our clock is measured and shown, not trusted (node/clock_offsets.py).

Not here: measuring offsets (node/clock_offsets.py), liveness (crdt/).
"""

from __future__ import annotations

CLOCK_SKEW_S = 300.0  # seconds either way: a signed time this far off our clock still counts
