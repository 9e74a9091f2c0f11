"""Fingerprints of CRDT digests, whole and by owner bucket: what anti-entropy compares first.

Problem. Anti-entropy (crdt/anti_entropy.py) starts with one 16-byte fingerprint per CRDT; when
two peers' fingerprints differ it used to send the CRDT's whole digest (owner -> (seq, signature
prefix), ~60 bytes per owner). In a large swarm the membership CRDT nearly always differs
somewhere — a heartbeat is in flight — so every exchange moved the whole digest: O(N) bytes per
peer per exchange, and N peers exchanging made the swarm's repair traffic O(N²).

Design. Owners are hashed into `count` buckets (`bucket_of`: blake2b of the owner id, mod a power
of two); a bucket's fingerprint is the fingerprint of the digest restricted to its owners. The
asker sends its per-bucket fingerprints with its whole-CRDT ones for every CRDT with at least
`MIN_BUCKETED` entries (`bucket_count`: about `ENTRIES_PER_BUCKET` owners per bucket, at most
`MAX_BUCKETS`); the answerer compares them with its own at the asker's count and returns the
digest of the differing buckets only, naming them. Both sides then compute deltas and pulls over
those buckets alone. A gossip round in flight touches a few owners, so an exchange moves a few
buckets: O(count · 16 + changed · N / count) bytes instead of O(N · 60). One level of buckets,
not a tree of ranges: with ~8 owners per bucket the fingerprints are already 8× smaller than
the digest they stand for, and one level keeps the exchange to one round trip.

Wire (added to crdt/digest and crdt/pull; peers without it ignore it and send whole digests):
`fb` {crdt: [fingerprint × count]} in a digest request; `b` {crdt: [count, [bucket, ...]]} in a
digest reply (its digest for that CRDT holds only those buckets) and in a pull request (deltas
over those buckets only). `parse_bucket_fingerprints` and `parse_bucket_scope` check both: a count
that is a power of two in [2, MAX_BUCKETS], 16-byte fingerprints, buckets in range and unique.

Not here: the exchange itself (crdt/anti_entropy.py), the entries and their merge (crdt/base.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from meshtrain.crdt.entries import Digest, MalformedCrdtData, digest_to_wire
from meshtrain.transport.framing import packb_canonical

FINGERPRINT_BYTES = 16
MIN_BUCKETED = 32  # entries a CRDT holds before its fingerprints are sent by bucket
ENTRIES_PER_BUCKET = 8
MAX_BUCKETS = 256


def fingerprint_of(digest: Digest) -> bytes:
    """A 16-byte hash of a digest: equal digests, equal fingerprints."""
    return hashlib.blake2b(packb_canonical(digest_to_wire(digest)), digest_size=FINGERPRINT_BYTES).digest()


def bucket_count(entries: int) -> int:
    """How many buckets a CRDT of `entries` owners is fingerprinted in (0: whole, it is small)."""
    if entries < MIN_BUCKETED:
        return 0
    want = -(-entries // ENTRIES_PER_BUCKET)
    return min(MAX_BUCKETS, max(2, 1 << (want - 1).bit_length()))


def bucket_of(owner: str, count: int) -> int:
    """The bucket of `owner` among `count` (a power of two); the same on every peer."""
    h = hashlib.blake2b(owner.encode(), digest_size=4).digest()
    return int.from_bytes(h, "big") & (count - 1)


def restrict(digest: Digest, buckets: Iterable[int], count: int) -> Digest:
    """The part of `digest` whose owners fall in `buckets`."""
    keep = set(buckets)
    return {o: v for o, v in digest.items() if bucket_of(o, count) in keep}


def bucket_fingerprints(digest: Digest, count: int) -> list[bytes]:
    """The fingerprint of each bucket's part of `digest`, bucket 0 first."""
    parts: list[Digest] = [{} for _ in range(count)]
    for owner, v in digest.items():
        parts[bucket_of(owner, count)][owner] = v
    return [fingerprint_of(p) for p in parts]


@dataclass(frozen=True)
class BucketScope:
    """Which buckets (of `count`) an exchange covers for one CRDT."""

    count: int
    buckets: frozenset[int]

    def covers(self, owner: str) -> bool:
        return bucket_of(owner, self.count) in self.buckets

    def to_wire(self) -> list[Any]:
        return [self.count, sorted(self.buckets)]


def _valid_count(count: Any) -> bool:
    return (
        isinstance(count, int)
        and not isinstance(count, bool)
        and 2 <= count <= MAX_BUCKETS
        and count & (count - 1) == 0
    )


def parse_bucket_fingerprints(obj: Any, names: Mapping[str, Any]) -> dict[str, list[bytes]]:
    """A digest request's `fb`, checked (`MalformedCrdtData`); CRDTs we do not keep are dropped."""
    if not isinstance(obj, dict) or len(obj) > len(names) + 16:
        raise MalformedCrdtData("fb must be a small map of CRDT name -> bucket fingerprints")
    out: dict[str, list[bytes]] = {}
    for name, fps in obj.items():
        if not isinstance(fps, list) or not _valid_count(len(fps)):
            raise MalformedCrdtData(f"fb[{name!r:.60}]: a list of 2..{MAX_BUCKETS} fingerprints, a power of two")
        if not all(isinstance(fp, bytes) and len(fp) == FINGERPRINT_BYTES for fp in fps):
            raise MalformedCrdtData(f"fb[{name!r:.60}]: fingerprints are {FINGERPRINT_BYTES} bytes")
        if isinstance(name, str) and name in names:
            out[name] = fps
    return out


def parse_bucket_scope(obj: Any, names: Mapping[str, Any]) -> dict[str, BucketScope]:
    """A digest reply's or pull request's `b`, checked (`MalformedCrdtData`); CRDTs we do not keep
    are dropped."""
    if not isinstance(obj, dict) or len(obj) > len(names) + 16:
        raise MalformedCrdtData("b must be a small map of CRDT name -> [count, buckets]")
    out: dict[str, BucketScope] = {}
    for name, scope in obj.items():
        if not (isinstance(scope, list) and len(scope) == 2 and _valid_count(scope[0]) and isinstance(scope[1], list)):
            raise MalformedCrdtData(f"b[{name!r:.60}]: [count (a power of two), [bucket, ...]]")
        count, buckets = scope
        if len(buckets) > count or len(set(buckets)) != len(buckets):
            raise MalformedCrdtData(f"b[{name!r:.60}]: buckets repeat or outnumber {count}")
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < count for i in buckets):
            raise MalformedCrdtData(f"b[{name!r:.60}]: a bucket is not in 0..{count - 1}")
        if isinstance(name, str) and name in names:
            out[name] = BucketScope(count, frozenset(buckets))
    return out
