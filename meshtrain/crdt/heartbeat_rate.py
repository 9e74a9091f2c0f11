"""How often a swarm's peers heartbeat, and how long their leases last, as the swarm grows.

The problem. Every heartbeat is flooded to every peer (~1.5 ms of py-libp2p CPU per frame),
so what a peer forwards follows the swarm's heartbeat rate, which `heartbeat_interval_for` keeps
at `swarm_heartbeat_rate · max(1, log₁₆ N)` (4/s up to 16 live peers, 6 at 64, 8 at 256): the
interval is max(`heartbeat_interval`, N / that) — 3 s up to 12 peers, 10.7 s at 64, 32 s at 256 —
at most `max_heartbeat_interval` (300 s, reached near 3,500 peers; above, gossip grows with N).
The lease scales with the interval (`ttl` at the shortest) and is in the signed record, so every
reader judges a peer by the same numbers. The price is detection: a peer that dies without
leaving stays live up to its lease (12 s up to 12 peers, 43 s at 64, 128 s at 256), while a clean
`leave()` is seen at once and round candidates drop a closed connection at once (node/presence.py).
Why not digests or sampling instead: every peer needs every live record once per lease to agree
on one membership snapshot, so stretching the lease is the knob, and no wire format changes.

Not here: writing and reading the records (swarm_view.py), their formats (swarm_records.py).
"""

from __future__ import annotations

import math

DEFAULT_HEARTBEAT_INTERVAL = 3.0
DEFAULT_TTL = 12.0  # the lease at the shortest interval: four missed heartbeats
DEFAULT_MAX_HEARTBEAT_INTERVAL = 300.0  # the log-N bound holds up to ~3,500 peers (docstring)
DEFAULT_SWARM_HEARTBEAT_RATE = 4.0  # heartbeats per second, whole swarm, up to LOG_RATE_FROM peers
LOG_RATE_FROM = 16  # above this many live peers the swarm's heartbeat rate grows with log N


def heartbeat_interval_for(
    live: int,
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
    swarm_heartbeat_rate: float = DEFAULT_SWARM_HEARTBEAT_RATE,
    max_heartbeat_interval: float = DEFAULT_MAX_HEARTBEAT_INTERVAL,
) -> float:
    """Seconds between heartbeats among `live` live peers (module docstring)."""
    rate = swarm_heartbeat_rate * max(1.0, math.log(max(live, 1), LOG_RATE_FROM))
    return min(max_heartbeat_interval, max(heartbeat_interval, live / rate))


def progress_gap_for(live: int, heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL, **rates: float) -> float:
    """The least seconds between two progress writes of one peer among `live` live peers: the
    heartbeat interval's stretch past its shortest (swarm_view.py, "Progress and metrics").
    `rates`: the other arguments of `heartbeat_interval_for`."""
    return max(0.0, heartbeat_interval_for(live, heartbeat_interval, **rates) - heartbeat_interval)
