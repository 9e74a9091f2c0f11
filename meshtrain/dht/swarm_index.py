"""The swarm index: swarms advertise themselves under one well-known DHT key, `/meshtrain/swarms`.

Problem. A user who wants to join a public run knows no peer of it. Every meshtrain node joins
the same DHT (`kademlia.NETWORK`), so one key that every swarm writes to lists them all, and
any node is an entry point.

Design. A few peers of each swarm (the node layer picks them: the owner, then the first admitted
peers by id, `node/presence.py`) store an *advert* under `SWARMS_KEY` with subkey
`<advertiser peer id>/<swarm id>` (so only the advertiser can write it, and one advertiser may
advertise one record per swarm). The value:

    {"swarm": swarm id, "spec": the signed spec document (SignedSpec.to_wire(), owner-signed),
     "peers": live peers it counts, "step": the swarm's step, "addrs": [its own multiaddrs],
     "proof": its admission proof (the proof-of-work nonce) or nil,
     "excluded": peers the swarm's strikes exclude, as it counts them (optional, default 0)}

The DHT record is signed by the advertiser (`records.py`), so nobody else can change an advert;
the spec inside is signed by the swarm's owner, and the swarm id is a digest of the spec and the
owner, so nobody can advertise a swarm under another's id or give it another name, model or
rule. What an advertiser can lie about is its own numbers (peers, step) and its own addresses:
the reader checks the spec and the advertiser's admission (node/spec/listing.py) and prefers the
owner's numbers. This module checks only the advert's shape and that every address names the
advertiser; `read_adverts` drops (and logs) anything else, never raises for it.

Records expire after `ttl` (`DEFAULT_ADVERT_TTL`) and advertisers refresh them well before, so a
swarm whose peers all stopped leaves the index within a few minutes.

Failures. No replica reachable: `publish_advert` raises `DhtError` (the caller logs and retries
at its next refresh). A value too large for a record (a spec with a very long allowlist) is
`InvalidRecord` ("oversized"): that swarm is not listed.

Not here: verifying the spec and the advertiser (node layer), choosing advertisers, the table
`meshtrain swarm list` prints. Limits: all adverts share one key, bounded by `RecordLimits`
(512 KiB, 1024 subkeys by default): about a hundred swarms of three advertisers each, and a
flood of junk adverts from many identities could crowd honest ones out of it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from meshtrain.dht.kademlia import Dht
from meshtrain.dht.records import Record
from meshtrain.log import get_logger, kv
from meshtrain.transport.host import dialable_addrs, parse_multiaddr, peer_id_of
from meshtrain.transport.validate import is_int

log = get_logger(__name__)

SWARMS_KEY = "/meshtrain/swarms"
DEFAULT_ADVERT_TTL = 120.0  # seconds an advert lives; advertisers refresh every third of it
MAX_ADVERT_ADDRS = 4
MAX_SWARM_ID_CHARS = 64
INT64_MAX = (1 << 63) - 1


def advert_subkey(advertiser: str, swarm_id: str) -> str:
    return f"{advertiser}/{swarm_id}"


@dataclass(frozen=True)
class SwarmAdvert:
    """One advertiser's advert for one swarm, shape-checked; its spec is not verified yet."""

    swarm_id: str
    spec: dict[str, Any]  # the owner-signed spec document, as received
    peers: int
    step: int
    addrs: tuple[str, ...]  # the advertiser's own multiaddrs (each names it)
    proof: Any  # the advertiser's admission proof (a proof-of-work nonce), or None
    advertiser: str
    expiry: float
    excluded: int = 0  # peers excluded by the swarm's strikes, as the advertiser counts them

    @classmethod
    def from_record(cls, record: Record) -> SwarmAdvert | None:
        """The advert in a validated record, or None if it is not a well-formed one."""
        value = record.decoded
        if not isinstance(value, dict):
            return None
        swarm, spec, peers, step, addrs = (value.get(k) for k in ("swarm", "spec", "peers", "step", "addrs"))
        if not isinstance(swarm, str) or not 0 < len(swarm) <= MAX_SWARM_ID_CHARS:
            return None
        if record.subkey != advert_subkey(record.owner, swarm) or not isinstance(spec, dict):
            return None
        if not (is_int(peers) and 0 <= peers <= INT64_MAX and is_int(step) and 0 <= step <= INT64_MAX):
            return None
        if not isinstance(addrs, list):
            return None
        good = []
        for a in addrs[:MAX_ADVERT_ADDRS]:
            try:
                if isinstance(a, str) and peer_id_of(parse_multiaddr(a)) == record.owner:
                    good.append(a)
            except Exception:  # not a multiaddr of this advertiser: drop that address only
                continue
        excluded = value.get("excluded", 0)
        if not (is_int(excluded) and 0 <= excluded <= INT64_MAX):
            return None
        return cls(swarm, spec, peers, step, tuple(good), value.get("proof"), record.owner, record.expiry, excluded)


async def publish_advert(
    dht: Dht,
    *,
    swarm_id: str,
    spec: dict[str, Any],
    peers: int,
    step: int,
    proof: Any = None,
    ttl: float = DEFAULT_ADVERT_TTL,
    excluded: int = 0,
    addrs: Sequence[str] | None = None,
) -> int:
    """Store our advert for `swarm_id`, naming `addrs` (default: our host's; behind NAT, our
    circuit addresses), the dialable ones with /p2p/. Returns the number of replicas; raises
    `DhtError` (none reachable) or `InvalidRecord` (e.g. oversized)."""
    addrs = dialable_addrs(dht.host.addrs if addrs is None else addrs, dht.peer_id)[:MAX_ADVERT_ADDRS]
    value = {"swarm": swarm_id, "spec": spec, "peers": peers, "step": step, "addrs": addrs, "proof": proof}
    if excluded:
        value["excluded"] = excluded
    return await dht.store(SWARMS_KEY, value, time.time() + ttl, subkey=advert_subkey(dht.peer_id, swarm_id))


async def read_adverts(dht: Dht) -> list[SwarmAdvert]:
    """Every live, well-formed advert the DHT holds, sorted by swarm id then advertiser."""
    out = []
    for record in (await dht.get_records(SWARMS_KEY)).values():
        advert = SwarmAdvert.from_record(record)
        if advert is None:
            log.info(kv("malformed swarm advert", owner=record.owner))
            continue
        out.append(advert)
    return sorted(out, key=lambda a: (a.swarm_id, a.advertiser))
