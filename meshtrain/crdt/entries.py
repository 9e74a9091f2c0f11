"""Signed single-writer entries: the unit every meshtrain CRDT is built from.

What: a `SignedEntry(owner, seq, body, signature)` is one owner's statement about its own part of a
CRDT. `seq` counts that owner's writes (1, 2, ...); `body` is a msgpack value whose meaning belongs
to the CRDT type; `signature` is the owner's Ed25519 signature over

    packb_canonical([SIGNING_DOMAIN, namespace, crdt_name, type_tag, owner, seq, body])

Why: peers are untrusted, and entries are relayed by peers other than their author (gossip,
anti-entropy). Signing each entry lets any relay forward it while only its owner can have written
it. The namespace (swarm id), the CRDT's name and its type are inside the signed bytes, so an entry
cannot be replayed into another swarm, another CRDT of the same swarm, or a CRDT of another type.
`SIGNING_DOMAIN` separates these signatures from everything else the same key signs (DHT records,
swarm specs): no other message of ours starts with that string. An Ed25519 peer id inlines the
public key, so the owner's peer id is all a verifier needs.

Also here: the wire form of entry batches (a delta and a full state have the same form), the
anti-entropy digest, and `SignatureCache`, which remembers verified signatures so the same entry
arriving from several peers (or in a merge of two in-memory states) is verified once. The cache
is keyed by a hash of the whole signed payload plus the signature, never by (owner, seq,
signature) alone: that would let a forger attach a new body to a signature we once verified.

What it does not do: merging and type semantics (`base.py`, `types.py`) and any I/O (`replica`).
Decoding untrusted bytes raises only `CrdtError` subclasses; inputs are checked explicitly.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from meshtrain.errors import MeshtrainError
from meshtrain.transport.framing import (
    DEFAULT_MAX_FRAME,
    WireError,
    canonical,
    packb_canonical,
    unpackb,
)
from meshtrain.transport.identity import Identity, IdentityError, public_key_of
from meshtrain.transport.validate import is_int

SIGNING_DOMAIN = "meshtrain/crdt-entry/v1"
WIRE_VERSION = 1

SIGNATURE_BYTES = 64  # Ed25519
MAX_OWNER_CHARS = 128  # an Ed25519 peer id in base58 is 52 characters
MAX_NAME_CHARS = 256  # namespace, CRDT name, type tag
MAX_SEQ = (1 << 63) - 1
# Nesting limit for bodies; it also keeps the recursive `canonical` far from the recursion limit.
MAX_VALUE_DEPTH = 32
INT_MIN = -(1 << 63)  # msgpack's integer range
INT_MAX = (1 << 64) - 1
DIGEST_PREFIX_BYTES = 16  # 128 bits: an owner cannot grind two signatures with equal prefixes

DEFAULT_CACHE_CAPACITY = 1 << 16


class CrdtError(MeshtrainError):
    """A CRDT operation or CRDT data is invalid. Every error this package raises is one."""


class MalformedCrdtData(CrdtError):
    """Bytes or a decoded value from a peer are not a valid entry batch, entry or digest."""


class RejectedEntries(CrdtError):
    """Entries failed verification where the caller asked for all-or-nothing (`from_bytes`)."""


class NotAWriter(CrdtError):
    """This identity is not in the CRDT's `writers` allow-list, so it may not write to it."""


def check_value(value: Any, *, what: str = "value") -> None:
    """Raise `MalformedCrdtData` unless `value` is a msgpack value we can encode canonically.

    Allowed: None, bool, int (msgpack range), float, str, bytes, lists/tuples, and maps whose keys
    are str or int (not bool: True and 1 are equal Python keys but encode differently), nested at
    most `MAX_VALUE_DEPTH` deep. Iterative, so a hostile value cannot exhaust the stack.
    """
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if v is None or isinstance(v, bool | float | str | bytes):
            continue
        if isinstance(v, int):
            if not INT_MIN <= v <= INT_MAX:
                raise MalformedCrdtData(f"{what}: integer {v} is outside msgpack's range")
            continue
        if depth >= MAX_VALUE_DEPTH:
            raise MalformedCrdtData(f"{what}: nested deeper than {MAX_VALUE_DEPTH} levels")
        if isinstance(v, list | tuple):
            stack.extend((x, depth + 1) for x in v)
        elif isinstance(v, dict):
            for k, x in v.items():
                if not (is_int(k) or isinstance(k, str)):
                    raise MalformedCrdtData(f"{what}: map key {k!r:.40} is not a str or int")
                if isinstance(k, int) and not INT_MIN <= k <= INT_MAX:
                    raise MalformedCrdtData(f"{what}: integer key {k} is outside msgpack's range")
                stack.append((x, depth + 1))
        else:
            raise MalformedCrdtData(f"{what}: {type(v).__name__} is not a msgpack value")


def _check_name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME_CHARS:
        raise CrdtError(f"{what} must be a non-empty str of at most {MAX_NAME_CHARS} characters")
    return value


@dataclass(frozen=True)
class EntryScope:
    """Where an entry belongs: the swarm (namespace), the CRDT's name, and its type tag."""

    namespace: str
    crdt_name: str
    type_tag: str

    def __post_init__(self) -> None:
        _check_name(self.namespace, "namespace")
        _check_name(self.crdt_name, "CRDT name")
        _check_name(self.type_tag, "type tag")

    def signing_payload(self, owner: str, seq: int, body: Any) -> bytes:
        """The exact bytes an owner signs for an entry in this scope."""
        return packb_canonical([SIGNING_DOMAIN, self.namespace, self.crdt_name, self.type_tag, owner, seq, body])


@dataclass(frozen=True, eq=False)
class SignedEntry:
    """One owner's signed write. `body` is canonical (lists, not tuples) and must not be mutated.

    Equality compares owner, seq, signature and the body's canonical bytes (not Python `==`, under
    which 0.0 == -0.0 and NaN != NaN although their encodings say otherwise).
    """

    owner: str
    seq: int
    body: Any
    signature: bytes

    @cached_property
    def body_bytes(self) -> bytes:
        return packb_canonical(self.body)

    @property
    def order_key(self) -> tuple[int, bytes]:
        """How two entries of one owner are ordered: later seq wins; equal seqs (the owner wrote
        twice with one seq, e.g. after losing its state) resolve to the larger signature, so every
        replica picks the same one whatever order they arrive in."""
        return (self.seq, self.signature)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SignedEntry):
            return NotImplemented
        return (
            self.owner == other.owner
            and self.seq == other.seq
            and self.signature == other.signature
            and self.body_bytes == other.body_bytes
        )

    def __hash__(self) -> int:
        return hash((self.owner, self.seq, self.signature))

    def __repr__(self) -> str:
        return (
            f"SignedEntry(owner={self.owner[-8:]!r}, seq={self.seq}, "
            f"body={self.body!r:.60}, sig={self.signature[:4].hex()}…)"
        )

    def to_wire(self) -> list[Any]:
        return [self.owner, self.seq, self.body, self.signature]

    @classmethod
    def from_wire(cls, obj: Any) -> SignedEntry:
        """Check the shape of a decoded entry; `MalformedCrdtData` if anything is off.

        Only the structure is checked here; the signature and the type's body rules are checked
        when the entry is merged (`SignedCrdt.apply`).
        """
        if not isinstance(obj, list) or len(obj) != 4:
            raise MalformedCrdtData("an entry is a 4-element array [owner, seq, body, signature]")
        owner, seq, body, signature = obj
        check_entry_fields(owner, seq, body, signature)
        # Re-canonicalise so an entry decoded from a peer is stored exactly as its owner signed
        # it (map order on the wire is the sender's choice; the signature covers sorted maps).
        return cls(owner, seq, canonical(body), signature)


def check_entry_fields(owner: Any, seq: Any, body: Any, signature: Any) -> None:
    """Raise `MalformedCrdtData` unless the four fields have an entry's types and limits."""
    if not isinstance(owner, str) or not 0 < len(owner) <= MAX_OWNER_CHARS:
        raise MalformedCrdtData(f"entry owner must be a str of 1..{MAX_OWNER_CHARS} characters")
    if not is_int(seq) or not 1 <= seq <= MAX_SEQ:
        raise MalformedCrdtData(f"entry seq must be an int in 1..{MAX_SEQ}")
    if not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
        raise MalformedCrdtData(f"entry signature must be {SIGNATURE_BYTES} bytes")
    check_value(body, what="entry body")


class SignatureCache:
    """Remembers which (signed payload, signature) pairs verified, and owners' public keys.

    Only successes are cached: a forged entry costs its sender one verification per delivery, and
    caching failures would let a flood of junk evict useful entries. Bounded LRU.
    """

    def __init__(self, capacity: int = DEFAULT_CACHE_CAPACITY) -> None:
        self.capacity = capacity
        self._verified: OrderedDict[bytes, None] = OrderedDict()
        self._keys: OrderedDict[str, Ed25519PublicKey | None] = OrderedDict()
        self.verifications = 0  # Ed25519 verifications actually performed (for tests/metrics)

    @staticmethod
    def _fingerprint(payload: bytes, signature: bytes) -> bytes:
        # The signature has a fixed length, so signature || payload is unambiguous.
        return hashlib.blake2b(signature + payload, digest_size=32).digest()

    def remember(self, payload: bytes, signature: bytes) -> None:
        """Record a pair known to be valid (e.g. one we just signed ourselves)."""
        self._remember(self._fingerprint(payload, signature))

    def _remember(self, fp: bytes) -> None:
        self._verified[fp] = None
        self._verified.move_to_end(fp)
        while len(self._verified) > self.capacity:
            self._verified.popitem(last=False)

    def _public_key(self, owner: str) -> Ed25519PublicKey | None:
        if owner in self._keys:
            self._keys.move_to_end(owner)
            return self._keys[owner]
        try:
            key: Ed25519PublicKey | None = Ed25519PublicKey.from_public_bytes(public_key_of(owner))
        except (IdentityError, ValueError, TypeError):
            key = None  # not a peer id that carries an Ed25519 key: nothing it signs verifies
        self._keys[owner] = key
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)
        return key

    def verify(self, owner: str, payload: bytes, signature: bytes) -> bool:
        fp = self._fingerprint(payload, signature)
        if fp in self._verified:
            self._verified.move_to_end(fp)
            return True
        key = self._public_key(owner)
        if key is None:
            return False
        self.verifications += 1
        try:
            key.verify(signature, payload)
        except (InvalidSignature, ValueError, TypeError):
            return False
        self._remember(fp)
        return True


DEFAULT_SIGNATURE_CACHE = SignatureCache()


def sign_entry(
    identity: Identity,
    scope: EntryScope,
    seq: int,
    body: Any,
    *,
    cache: SignatureCache | None = None,
) -> SignedEntry:
    """Sign `body` as entry `seq` of `identity` in `scope`. `CrdtError` if `body` is not encodable."""
    if not is_int(seq) or not 1 <= seq <= MAX_SEQ:
        raise CrdtError(f"seq must be an int in 1..{MAX_SEQ}, got {seq!r:.40}")
    check_value(body, what="entry body")
    body = canonical(body)
    owner = identity.peer_id_str
    payload = scope.signing_payload(owner, seq, body)
    signature = identity.sign(payload)
    (cache or DEFAULT_SIGNATURE_CACHE).remember(payload, signature)
    return SignedEntry(owner, seq, body, signature)


def verify_entry(
    scope: EntryScope,
    entry: SignedEntry,
    *,
    writers: frozenset[str] | None = None,
    cache: SignatureCache | None = None,
) -> bool:
    """True if `entry` was signed by its owner for `scope` and the owner may write (`writers`)."""
    if writers is not None and entry.owner not in writers:
        return False
    payload = scope.signing_payload(entry.owner, entry.seq, entry.body)
    return (cache or DEFAULT_SIGNATURE_CACHE).verify(entry.owner, payload, entry.signature)


@dataclass(frozen=True)
class Rejection:
    """An entry `apply` refused, and why (for logs and for scoring the peer that sent it)."""

    entry: SignedEntry
    reason: str


@dataclass(frozen=True)
class MergeOutcome:
    """What merging a batch of entries did.

    `accepted`: the entries now in the state that were not before (at most one per owner) —
    exactly what a replica should re-gossip. `rejected`: entries that would have changed the state
    but failed a check. Entries that would not have changed the state (duplicates, older seqs) are
    in neither and were not verified.
    """

    accepted: tuple[SignedEntry, ...] = ()
    rejected: tuple[Rejection, ...] = ()

    @property
    def changed(self) -> bool:
        return bool(self.accepted)


# --- wire form of entry batches -------------------------------------------------------------------
# A batch is [WIRE_VERSION, type_tag, [entry, ...]] with entries sorted by (owner, seq, signature),
# so a state (one entry per owner) encodes to the same bytes whatever order it was built in.


def entries_to_wire(entries: Iterable[SignedEntry]) -> list[list[Any]]:
    ordered = sorted(entries, key=lambda e: (e.owner, e.seq, e.signature))
    return [e.to_wire() for e in ordered]


def entries_from_wire(obj: Any) -> list[SignedEntry]:
    if not isinstance(obj, list):
        raise MalformedCrdtData("entries must be an array")
    return [SignedEntry.from_wire(item) for item in obj]


def encode_entries(type_tag: str, entries: Iterable[SignedEntry]) -> bytes:
    return packb_canonical([WIRE_VERSION, type_tag, entries_to_wire(entries)])


def unpack_envelope(
    data: bytes | bytearray | memoryview, *, max_size: int, version: int, what: str, layout: str
) -> tuple[Any, Any]:
    """The two fields of an untrusted msgpack `[version, a, b]` envelope of the expected version;
    `MalformedCrdtData` (naming `what`) for anything else. Shared by CRDT batches and gossip."""
    try:
        obj = unpackb(data, max_size=max_size)
    except WireError as e:
        raise MalformedCrdtData(f"undecodable {what}: {e}") from None
    if not isinstance(obj, list) or len(obj) != 3:
        raise MalformedCrdtData(f"a {what} is {layout}")
    got, a, b = obj
    if type(got) is not int or got != version:
        raise MalformedCrdtData(f"unsupported {what} version {got!r:.20}")
    return a, b


def decode_entries(
    data: bytes | memoryview,
    *,
    expected_type: str | None = None,
    max_size: int = DEFAULT_MAX_FRAME,
) -> tuple[str, list[SignedEntry]]:
    """Decode an untrusted batch into (type_tag, entries). Raises only `MalformedCrdtData`."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise MalformedCrdtData(f"expected bytes, got {type(data).__name__}")
    type_tag, raw_entries = unpack_envelope(
        data, max_size=max_size, version=WIRE_VERSION, what="CRDT batch", layout="[version, type, entries]"
    )
    if not isinstance(type_tag, str) or not 0 < len(type_tag) <= MAX_NAME_CHARS:
        raise MalformedCrdtData("a CRDT batch's type tag must be a short str")
    if expected_type is not None and type_tag != expected_type:
        raise MalformedCrdtData(f"batch holds {type_tag!r:.40} entries, expected {expected_type!r}")
    return type_tag, entries_from_wire(raw_entries)


# --- anti-entropy digest ------------------------------------------------------------------------
# owner -> (seq, first DIGEST_PREFIX_BYTES of the signature) of the entry a replica holds. The
# signature prefix lets two replicas that hold *different* entries with the same (owner, seq) (an
# equivocation) tell which of them holds the winner; a plain version vector (owner -> seq) is also
# accepted and reads as "prefix unknown", i.e. "send only higher seqs".

Digest = dict[str, tuple[int, bytes]]


def digest_to_wire(digest: Mapping[str, tuple[int, bytes]]) -> dict[str, list[Any]]:
    return {owner: [seq, prefix] for owner, (seq, prefix) in digest.items()}


def digest_from_wire(obj: Any) -> Digest:
    """Check an untrusted digest (a decoded map); raises only `MalformedCrdtData`."""
    if not isinstance(obj, dict):
        raise MalformedCrdtData("a digest is a map owner -> [seq, signature prefix] or seq")
    out: Digest = {}
    for owner, value in obj.items():
        if not isinstance(owner, str) or not 0 < len(owner) <= MAX_OWNER_CHARS:
            raise MalformedCrdtData("digest owner must be a short str")
        if is_int(value):
            seq, prefix = value, b""
        elif isinstance(value, list | tuple) and len(value) == 2:
            seq, prefix = value
        else:
            raise MalformedCrdtData("digest value must be [seq, signature prefix] or seq")
        if not is_int(seq) or not 0 <= seq <= MAX_SEQ:
            raise MalformedCrdtData(f"digest seq must be an int in 0..{MAX_SEQ}")
        if not isinstance(prefix, bytes) or len(prefix) > SIGNATURE_BYTES:
            raise MalformedCrdtData(f"digest signature prefix must be at most {SIGNATURE_BYTES} bytes")
        out[owner] = (seq, prefix)
    return out
