"""`SignedCrdt`: the machinery every meshtrain CRDT shares — each owner's latest signed entry.

Design. A CRDT's state is a map owner -> that owner's latest `SignedEntry`, and each entry's body
is the owner's *whole* contribution (its count, its register value, its keys of a map, its adds
and removes of a set), not one operation. Consequences, and why we chose this:

- Merge is a product of per-owner maxima: for each owner keep the entry with the larger
  `(seq, signature)`. That is commutative, associative and idempotent by construction, for every
  type, and the value is a pure function of the state. Two different validly signed entries with
  the same (owner, seq) — an owner that lost its state and wrote again — resolve to the larger
  signature everywhere.
- The version vector (owner -> seq held) describes the state exactly, so anti-entropy is simple
  and sound: `delta_since(their_digest)` is every entry whose (seq, signature) beats theirs. With
  per-operation entries a replica holding seq 7 of an owner need not hold seqs 1..6, and a
  version vector could not say what is missing.
- State stays bounded by the number of owners times the size of one owner's contribution; older
  entries are superseded, never kept. The cost: a delta is the owner's whole contribution, so an
  owner should keep its part small (a config map, one set member, a counter). Types document
  what, if anything, grows inside a contribution (LWWMap and ORSet tombstones).
- Only entries that would change the state are verified (Ed25519 verify is the expensive step),
  and verified signatures are cached (`SignatureCache`), so merging the same delta twice, or the
  same entries arriving from several peers, costs a dict lookup.

Mutability: `apply`/`merge` change the state in place and return a `MergeOutcome` naming the
entries that changed it (what a replica re-gossips) and those rejected; `copy()` for a snapshot.
Mutators (`GCounter.increment`, `LWWMap.set`, ...) take the writer's `Identity`, write that
owner's next entry and return it: the entry *is* the delta to gossip.

A replica that lost its state (and so restarts its seq at 1) should pull its own latest entry by
anti-entropy before writing; writes made before that lose to its older, higher-seq entry.

Not here: I/O, gossip, choosing peers (`replica`), and type semantics (`types.py`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Self

from meshtrain.crdt.entries import (
    DIGEST_PREFIX_BYTES,
    CrdtError,
    Digest,
    EntryScope,
    MalformedCrdtData,
    MergeOutcome,
    NotAWriter,
    RejectedEntries,
    Rejection,
    SignatureCache,
    SignedEntry,
    check_entry_fields,
    decode_entries,
    encode_entries,
    sign_entry,
    verify_entry,
)
from meshtrain.transport.framing import DEFAULT_MAX_FRAME
from meshtrain.transport.identity import Identity

_STALE = object()  # marks the cached value view as needing recomputation


class SignedCrdt:
    """Base class: a map owner -> latest signed entry, with merge, deltas, digests and encoding.

    Parameters:
    - `namespace`: the swarm id; bound into every signature so entries cannot cross swarms.
    - `name`: this CRDT's name within the swarm (e.g. "membership"); also bound into signatures.
    - `writers`: if given, only these peer ids may write; entries by anyone else are rejected on
      merge and local writes by anyone else raise `NotAWriter` (e.g. the swarm config map is
      writable only by the swarm owner's key).
    - `cache`: where verified signatures are remembered; defaults to one process-wide cache.

    Subclasses set `type_tag` (also bound into signatures), implement `check_body` (the type's
    rules for a body; every replica applies the same rules, so rejections agree) and
    `_compute_view` (the value, recomputed lazily after a change).
    """

    type_tag: ClassVar[str] = ""

    def __init__(
        self,
        namespace: str,
        name: str,
        *,
        writers: Iterable[str] | None = None,
        cache: SignatureCache | None = None,
    ) -> None:
        self.scope = EntryScope(namespace, name, self.type_tag)
        if writers is not None:
            writers = frozenset(writers)
            if not all(isinstance(w, str) for w in writers):
                raise CrdtError("writers must be peer id strings")
        self.writers: frozenset[str] | None = writers
        self._cache = cache
        self._entries: dict[str, SignedEntry] = {}
        self._view: Any = _STALE

    # --- subclass hooks -------------------------------------------------------------------------

    @classmethod
    def check_body(cls, entry: SignedEntry) -> None:
        """Raise `CrdtError` if `entry.body` breaks this type's rules."""
        raise NotImplementedError

    def _compute_view(self) -> Any:
        raise NotImplementedError

    def _current_view(self) -> Any:
        if self._view is _STALE:
            self._view = self._compute_view()
        return self._view

    # --- reading --------------------------------------------------------------------------------

    @property
    def namespace(self) -> str:
        return self.scope.namespace

    @property
    def name(self) -> str:
        return self.scope.crdt_name

    def entries(self) -> list[SignedEntry]:
        """Every owner's latest entry, sorted by owner."""
        return [self._entries[o] for o in sorted(self._entries)]

    def entry(self, owner: str) -> SignedEntry | None:
        return self._entries.get(owner)

    def owners(self) -> list[str]:
        return sorted(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def version_vector(self) -> dict[str, int]:
        """owner -> seq of the entry held."""
        return {o: e.seq for o, e in self._entries.items()}

    def digest(self) -> Digest:
        """owner -> (seq, signature prefix): what a peer needs to compute our `delta_since`."""
        return {o: (e.seq, e.signature[:DIGEST_PREFIX_BYTES]) for o, e in self._entries.items()}

    def delta_since(self, digest: Mapping[str, int | tuple[int, bytes]]) -> list[SignedEntry]:
        """The entries that would change a replica whose digest (or version vector) is `digest`.

        A plain int in `digest` is a seq with unknown signature: only higher seqs are sent.
        Check a digest that came from a peer with `entries.digest_from_wire` first.
        """
        out = []
        for owner in sorted(self._entries):
            entry = self._entries[owner]
            known = digest.get(owner)
            if known is None:
                out.append(entry)
                continue
            seq, prefix = (known, b"") if isinstance(known, int) else known
            if (entry.seq, entry.signature[: len(prefix)]) > (seq, prefix):
                out.append(entry)
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SignedCrdt):
            return NotImplemented
        return type(self) is type(other) and self.scope == other.scope and self._entries == other._entries

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __le__(self, other: SignedCrdt) -> bool:
        """The CRDT partial order: every entry we hold is held or superseded in `other`."""
        if type(self) is not type(other) or self.scope != other.scope:
            return False
        for owner, mine in self._entries.items():
            theirs = other._entries.get(owner)
            if theirs is None or theirs.order_key < mine.order_key:
                return False
            if theirs.order_key == mine.order_key and theirs != mine:
                return False
        return True

    def __repr__(self) -> str:
        return f"{type(self).__name__}(namespace={self.namespace!r}, name={self.name!r}, owners={len(self._entries)})"

    # --- merging --------------------------------------------------------------------------------

    def apply(self, entries: Iterable[SignedEntry]) -> MergeOutcome:
        """Merge entries (a delta, or a decoded state) into this state, in place.

        An entry is considered only if it beats the held entry of its owner; then it must come
        from an allowed writer, have a well-formed body, and verify for its owner in this CRDT's
        scope, or it is rejected and the state is left as it was. The result does not depend on
        the order of `entries` or on duplicates among them.
        """
        accepted: dict[str, SignedEntry] = {}
        rejected: list[Rejection] = []
        for entry in entries:
            if not isinstance(entry, SignedEntry):
                raise CrdtError(f"can only merge SignedEntry values, got {type(entry).__name__}")
            if not (
                isinstance(entry.owner, str) and type(entry.seq) is int and isinstance(entry.signature, bytes)
            ):  # only entries built in-process can get here (`from_wire` checks these)
                rejected.append(Rejection(entry, "malformed entry: a field has the wrong type"))
                continue
            current = self._entries.get(entry.owner)
            if current is not None and entry.order_key <= current.order_key:
                continue  # held already, or superseded: no need to verify
            reason = self._rejection_reason(entry)
            if reason is not None:
                rejected.append(Rejection(entry, reason))
                continue
            self._entries[entry.owner] = entry
            accepted[entry.owner] = entry
        if accepted:
            self._view = _STALE
        return MergeOutcome(tuple(accepted[o] for o in sorted(accepted)), tuple(rejected))

    def merge(self, other: Self) -> MergeOutcome:
        """Merge another state of the same CRDT (same type, namespace and name) into this one."""
        if type(other) is not type(self) or other.scope != self.scope:
            raise CrdtError(
                f"cannot merge {type(other).__name__} {other.scope} into {type(self).__name__} {self.scope}"
            )
        return self.apply(list(other._entries.values()))

    def _rejection_reason(self, entry: SignedEntry) -> str | None:
        # Cheapest checks first; the signature last.
        if self.writers is not None and entry.owner not in self.writers:
            return "owner is not an allowed writer of this CRDT"
        try:
            check_entry_fields(entry.owner, entry.seq, entry.body, entry.signature)
            self.check_body(entry)
        except CrdtError as e:
            return f"malformed entry: {e}"
        if not verify_entry(self.scope, entry, cache=self._cache):
            return "signature does not verify for its owner in this namespace and CRDT"
        return None

    def copy(self) -> Self:
        clone = type(self)(self.namespace, self.name, writers=self.writers, cache=self._cache)
        clone._entries = dict(self._entries)
        return clone

    # --- writing --------------------------------------------------------------------------------

    def _write(self, identity: Identity, body: Any) -> SignedEntry:
        """Sign `body` as `identity`'s next entry, store it, and return it (the delta)."""
        owner = identity.peer_id_str
        if self.writers is not None and owner not in self.writers:
            raise NotAWriter(f"peer {owner} is not an allowed writer of CRDT {self.name!r}")
        current = self._entries.get(owner)
        seq = 1 if current is None else current.seq + 1
        entry = sign_entry(identity, self.scope, seq, body, cache=self._cache)
        self.check_body(entry)  # mutators validate their inputs first; this is the backstop
        self._entries[owner] = entry
        self._view = _STALE
        return entry

    def _own_entry(self, identity: Identity) -> SignedEntry | None:
        return self._entries.get(identity.peer_id_str)

    # --- encoding -------------------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        """The full state, canonically encoded: equal states give equal bytes."""
        return encode_entries(self.type_tag, self._entries.values())

    def encode_entries(self, entries: Iterable[SignedEntry]) -> bytes:
        """Encode a delta (e.g. `delta_since(...)` or a mutator's result) for the wire."""
        return encode_entries(self.type_tag, entries)

    @classmethod
    def decode_entries(cls, data: bytes | memoryview, *, max_size: int = DEFAULT_MAX_FRAME) -> list[SignedEntry]:
        """Decode an untrusted batch of this type's entries (not yet verified: `apply` does that).

        Raises only `MalformedCrdtData`.
        """
        _, entries = decode_entries(data, expected_type=cls.type_tag, max_size=max_size)
        return entries

    @classmethod
    def from_bytes(
        cls,
        data: bytes | memoryview,
        namespace: str,
        name: str,
        *,
        writers: Iterable[str] | None = None,
        cache: SignatureCache | None = None,
        max_size: int = DEFAULT_MAX_FRAME,
    ) -> Self:
        """Rebuild a full state from `to_bytes` output, verifying every entry.

        All-or-nothing: `MalformedCrdtData` if the bytes are not a state, `RejectedEntries` if
        any entry fails verification. (To keep the good entries of a partly bad batch, use
        `decode_entries` + `apply`, which reports rejections instead.)
        """
        state = cls(namespace, name, writers=writers, cache=cache)
        entries = cls.decode_entries(data, max_size=max_size)
        if len({e.owner for e in entries}) != len(entries):
            raise MalformedCrdtData("a state holds one entry per owner")
        outcome = state.apply(entries)
        if outcome.rejected:
            first = outcome.rejected[0]
            raise RejectedEntries(
                f"{len(outcome.rejected)} entries of {cls.__name__} {name!r} rejected; first: "
                f"owner {first.entry.owner}, seq {first.entry.seq}: {first.reason}"
            )
        return state
