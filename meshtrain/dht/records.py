"""DHT records: signed, expiring values, and the storing node's merge of a key's subkeys.

The problem. Many peers write under one key (every peer announces itself under
`/meshtrain/<swarm>/peers`), any peer may store or serve a record, and some peers lie. A reader
must be able to check every value it receives without trusting the peer that handed it over,
and concurrent writers must never erase each other.

Design (after hivemind's DHT values with subkeys, but signed by default).
- A `Record` is one entry of a key: `(key, subkey, value, expiry, owner, signature)`. The value
  is msgpack bytes (`packb_canonical` of what the caller stored) and stays those exact bytes on
  every hop, so the signature never depends on re-encoding. The owner signs
  `RECORD_DOMAIN + packb([swarm_id, key, subkey, value, expiry, owner])`: a record copied to
  another network, another key or another subkey, or with its value or expiry changed, fails.
  (`swarm_id` here names the DHT *network*, which all swarms share so that any node is an entry
  point to every swarm — `NETWORK` in kademlia.py — and a swarm's keys carry the swarm's id;
  the parameter kept its name.)
- A key's state is a map `subkey -> Record`. `subkey=None` is the key's *plain* value, which
  any peer may replace; every other subkey belongs to one owner: it must be the owner's peer id,
  or start with `<peer id>/`. Without that rule any swarm member could overwrite another peer's
  announcement by signing one with a later expiry.
- **Merge happens on the storing node** (`RecordStore.put`), never by a client's
  read-modify-write: per subkey the record with the later expiry wins (ties: owner, then
  signature bytes — a total order, so `merge` is commutative, associative and idempotent and
  replicas that saw the same records in any order agree); expired entries are dropped.
- Validation (`validate`) runs on every store *and* on every record a get returns: unsigned,
  forged, expired, dated further ahead than `max_ttl + clock_skew`, oversized (per value, per
  key, subkeys per key), malformed, or signed for another swarm/key is an `InvalidRecord` with
  a short machine-readable `reason`.
- Clocks. An expiry is a time on its writer's clock, read on ours. A writer ahead of us by up to
  `CLOCK_SKEW_S` (clock.py, five minutes: the one tolerance for peers' clocks) is never refused
  as "future"; its records live that much longer here. A writer behind us by Δ has its records
  expire Δ early here (a peer more than a minute behind is missing from discovery's 60 s
  announcements, and found through the swarm's membership instead, which does not depend on
  clocks: crdt/swarm_records.py). Tolerating that too would keep every dead writer's records for
  five more minutes on every node.

Not here: networking (`kademlia.py`, `routing.py`), what the swarm's announcements mean
(`discovery.py`).
Nothing in this module does I/O; the clock is always passed in as `now`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from meshtrain.clock import CLOCK_SKEW_S
from meshtrain.errors import MeshtrainError
from meshtrain.transport.framing import WireError, packb, packb_canonical, unpackb
from meshtrain.transport.identity import Identity, verify
from meshtrain.transport.validate import is_number

RECORD_DOMAIN = b"meshtrain/dht-record/v1\x00"

DEFAULT_MAX_VALUE_BYTES = 64 << 10  # one subkey's value
DEFAULT_MAX_KEY_BYTES = 512 << 10  # all entries of one key (an RPC frame is capped at 1 MiB)
DEFAULT_MAX_SUBKEYS = 1024
DEFAULT_MAX_KEYS = 100_000  # keys one node stores for others
DEFAULT_MAX_TTL = 3600.0  # seconds a record may live
DEFAULT_CLOCK_SKEW = CLOCK_SKEW_S  # how far ahead of our clock a peer's clock may be (clock.py)
MAX_KEY_CHARS = 256
MAX_SUBKEY_CHARS = 128
MAX_OWNER_CHARS = 128
SIGNATURE_BYTES = 64
ENTRY_OVERHEAD = 96  # wire bytes of a record beyond its value, subkey and owner (map keys, sig)

Subkey = str | None


class DhtError(MeshtrainError):
    """A DHT operation failed (no peer reachable, stored nowhere, bad bootstrap list)."""


class InvalidRecord(DhtError):
    """A record failed validation. `reason` is one short word, also sent to peers:
    unsigned, forged, expired, future, oversized, malformed, not_owner, key_full, store_full."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"invalid DHT record ({reason}){': ' + detail if detail else ''}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class RecordLimits:
    """What a node accepts. Every node of a swarm should use the same limits; a record one node
    accepts and another refuses is merely stored on fewer replicas.

    max_value_bytes: encoded size of one value.
    max_key_bytes: approximate wire size of all entries of one key (bounds a get reply).
    max_subkeys: entries per key.
    max_keys: distinct keys one node stores (bounds its memory).
    max_ttl: the furthest expiry a writer may choose, in seconds from now.
    clock_skew: tolerance for a writer whose clock runs ahead of ours.
    """

    max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES
    max_key_bytes: int = DEFAULT_MAX_KEY_BYTES
    max_subkeys: int = DEFAULT_MAX_SUBKEYS
    max_keys: int = DEFAULT_MAX_KEYS
    max_ttl: float = DEFAULT_MAX_TTL
    clock_skew: float = DEFAULT_CLOCK_SKEW


def signing_payload(swarm_id: str, key: str, subkey: Subkey, value: bytes, expiry: float, owner: str) -> bytes:
    """The exact bytes an owner signs. `expiry` is signed as a float, so 5 and 5.0 agree."""
    return RECORD_DOMAIN + packb([swarm_id, key, subkey, value, float(expiry), owner])


def subkey_owned_by(subkey: Subkey, owner: str) -> bool:
    """Whether `owner` may write `subkey`: the plain value (None) is anyone's; any other subkey
    is its owner's peer id, optionally followed by `/suffix`."""
    return subkey is None or subkey == owner or subkey.startswith(owner + "/")


@dataclass(frozen=True)
class Record:
    """One signed entry of a key. `value` is the msgpack encoding of the stored value."""

    key: str
    subkey: Subkey
    value: bytes
    expiry: float
    owner: str
    signature: bytes = field(repr=False)

    @classmethod
    def create(
        cls,
        identity: Identity,
        swarm_id: str,
        key: str,
        value: Any,
        expiry: float,
        subkey: Subkey = None,
    ) -> Record:
        """Encode and sign `value`. Does not validate (a writer checks with `validate`)."""
        encoded = packb_canonical(value)
        owner = identity.peer_id_str
        expiry = float(expiry)
        sig = identity.sign(signing_payload(swarm_id, key, subkey, encoded, expiry, owner))
        return cls(key, subkey, encoded, expiry, owner, sig)

    @cached_property
    def decoded(self) -> Any:
        """The stored value. Only call on a validated record (validation checks it decodes)."""
        return unpackb(self.value)

    @property
    def order(self) -> tuple[float, str, bytes]:
        """Which of two records for one subkey wins a merge: the larger."""
        return (self.expiry, self.owner, self.signature)

    @property
    def wire_size(self) -> int:
        return len(self.value) + len(self.subkey or "") + len(self.owner) + ENTRY_OVERHEAD

    def to_wire(self) -> dict[str, Any]:
        """The record as sent in an RPC (its key travels once, beside the records)."""
        return {"s": self.subkey, "v": self.value, "e": self.expiry, "o": self.owner, "g": self.signature}

    @classmethod
    def from_wire(cls, key: str, obj: Any) -> Record:
        """Check a record's shape as received from a peer; the signature is checked by `validate`."""
        if not isinstance(obj, dict):
            raise InvalidRecord("malformed", "a record is a map")
        subkey, value, expiry = obj.get("s"), obj.get("v"), obj.get("e")
        owner, sig = obj.get("o"), obj.get("g", b"")
        if subkey is not None and not isinstance(subkey, str):
            raise InvalidRecord("malformed", "subkey must be a string or nil")
        if not isinstance(value, bytes):
            raise InvalidRecord("malformed", "value must be bytes")
        if not is_number(expiry):
            raise InvalidRecord("malformed", "expiry must be a number")
        if not isinstance(owner, str) or not owner or len(owner) > MAX_OWNER_CHARS:
            raise InvalidRecord("malformed", "owner must be a peer id")
        if sig is None:
            sig = b""
        if not isinstance(sig, bytes):
            raise InvalidRecord("malformed", "signature must be bytes")
        if not isinstance(key, str):
            raise InvalidRecord("malformed", "key must be a string")
        return cls(key, subkey, value, float(expiry), owner, sig)


def validate(record: Record, swarm_id: str, *, now: float, limits: RecordLimits) -> None:
    """Raise `InvalidRecord` unless `record` is well-formed, live, within limits, owned and
    signed by its owner for this swarm and key. Cheap checks first, the signature last."""
    if not record.key or len(record.key) > MAX_KEY_CHARS:
        raise InvalidRecord("malformed", f"key must be 1..{MAX_KEY_CHARS} characters")
    if record.subkey is not None and not 0 < len(record.subkey) <= MAX_SUBKEY_CHARS:
        raise InvalidRecord("malformed", f"subkey must be 1..{MAX_SUBKEY_CHARS} characters")
    if not record.signature:
        raise InvalidRecord("unsigned")
    if len(record.signature) != SIGNATURE_BYTES:
        raise InvalidRecord("forged", "an Ed25519 signature is 64 bytes")
    if len(record.value) > limits.max_value_bytes:
        raise InvalidRecord("oversized", f"value of {len(record.value)} bytes exceeds {limits.max_value_bytes}")
    if not math.isfinite(record.expiry):
        raise InvalidRecord("malformed", "expiry must be finite")
    if record.expiry <= now:
        raise InvalidRecord("expired", f"expired {now - record.expiry:.1f} s ago")
    if record.expiry > now + limits.max_ttl + limits.clock_skew:
        raise InvalidRecord("future", f"expires in {record.expiry - now:.0f} s; the limit is {limits.max_ttl:.0f} s")
    if not subkey_owned_by(record.subkey, record.owner):
        raise InvalidRecord("not_owner", "a subkey is its owner's peer id or '<peer id>/...'")
    payload = signing_payload(swarm_id, record.key, record.subkey, record.value, record.expiry, record.owner)
    if not verify(record.owner, payload, record.signature):
        raise InvalidRecord("forged", "the signature does not verify for this swarm, key and owner")
    try:
        unpackb(record.value, max_size=limits.max_value_bytes)
    except WireError:
        raise InvalidRecord("malformed", "value is not msgpack") from None


def merge(*states: Mapping[Subkey, Record]) -> dict[Subkey, Record]:
    """Per subkey, the record with the largest `order`. Commutative, associative, idempotent."""
    out: dict[Subkey, Record] = {}
    for state in states:
        for subkey, rec in state.items():
            cur = out.get(subkey)
            if cur is None or rec.order > cur.order:
                out[subkey] = rec
    return out


def live(state: Mapping[Subkey, Record], now: float) -> dict[Subkey, Record]:
    """The entries that have not expired at `now`."""
    return {sk: r for sk, r in state.items() if r.expiry > now}


def as_state(records: Iterable[Record]) -> dict[Subkey, Record]:
    """Fold records of one key into a state (same rule as `merge`)."""
    out: dict[Subkey, Record] = {}
    for rec in records:
        cur = out.get(rec.subkey)
        if cur is None or rec.order > cur.order:
            out[rec.subkey] = rec
    return out


def plain_or_dict(state: Mapping[Subkey, Record]) -> Any:
    """What `Dht.get` returns: None if empty, the value if the key holds only a plain value,
    else `{subkey: value}` (a plain value, if any, appears under the subkey None)."""
    if not state:
        return None
    if set(state) == {None}:
        return state[None].decoded
    return {sk: r.decoded for sk, r in state.items()}


class RecordStore:
    """The records one node stores for the swarm: validates, merges, bounds memory.

    swarm_id: records signed for another swarm are refused.
    limits: value, key and store bounds (`RecordLimits`).
    """

    def __init__(self, swarm_id: str, limits: RecordLimits | None = None) -> None:
        self.swarm_id = swarm_id
        self.limits = limits or RecordLimits()
        self._keys: dict[str, dict[Subkey, Record]] = {}
        self._key_bytes: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def put(self, record: Record, now: float) -> bool:
        """Validate and merge one record. True if it changed the stored state, False if an equal
        or newer entry for its subkey was already here. Raises `InvalidRecord`."""
        validate(record, self.swarm_id, now=now, limits=self.limits)
        state = self._keys.get(record.key)
        if state is None:
            if len(self._keys) >= self.limits.max_keys:
                self.purge(now)
                if len(self._keys) >= self.limits.max_keys:
                    raise InvalidRecord("store_full", f"this node stores {len(self._keys)} keys")
            state = {}
        else:
            self._drop_expired(record.key, state, now)
        cur = state.get(record.subkey)
        if cur is not None and cur.order >= record.order:
            return False
        size = self._key_bytes.get(record.key, 0) - (cur.wire_size if cur else 0) + record.wire_size
        if cur is None and len(state) >= self.limits.max_subkeys:
            raise InvalidRecord("key_full", f"key holds {len(state)} subkeys")
        if size > self.limits.max_key_bytes:
            raise InvalidRecord("key_full", f"key would hold {size} bytes")
        state[record.subkey] = record
        self._keys[record.key] = state
        self._key_bytes[record.key] = size
        return True

    def get(self, key: str, now: float) -> dict[Subkey, Record]:
        """The live entries of `key` (a copy)."""
        state = self._keys.get(key)
        if state is None:
            return {}
        self._drop_expired(key, state, now)
        return dict(state)

    def keys(self) -> list[str]:
        return list(self._keys)

    def purge(self, now: float) -> int:
        """Drop every expired entry; returns how many."""
        dropped = 0
        for key, state in list(self._keys.items()):
            dropped += self._drop_expired(key, state, now)
        return dropped

    def _drop_expired(self, key: str, state: dict[Subkey, Record], now: float) -> int:
        dead = [sk for sk, r in state.items() if r.expiry <= now]
        for sk in dead:
            self._key_bytes[key] -= state.pop(sk).wire_size
        if not state:
            self._keys.pop(key, None)
            self._key_bytes.pop(key, None)
        return len(dead)
