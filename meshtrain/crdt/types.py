"""The CRDT types the swarm's shared state is made of.

- `GCounter`, `PNCounter`: totals across peers (samples processed, bytes sent).
- `MaxRegister`: each owner's monotone value (its training step, its outer round); the value is
  the map owner -> value, so "how far is everyone" needs no leader.
- `LWWRegister`: one value, last writer wins (e.g. the current outer round's plan).
- `LWWMap`: keys to values, last writer wins per key (the run config, written by the swarm owner
  only: pass `writers={owner_peer_id}`).
- `ORSet`: observed-remove set, add wins over a concurrent remove (membership).

Every type is a `SignedCrdt` (see `base.py`): the state is each owner's latest signed entry, whose
body is that owner's whole contribution, so merge is per-owner "latest wins" and all the lattice
laws hold for every type alike. What differs is the body and how the value is read from all
owners' bodies. Each class's docstring gives its body format and what can grow in it.

Last-writer-wins order is (timestamp, owner peer id): timestamps are integers in milliseconds
since the epoch chosen by the writer, ties go to the larger peer id, so every replica agrees.
Without an explicit `timestamp`, a write takes max(now, the current winner's timestamp + 1), so a
write made after seeing a value supersedes it even if the writer's clock is behind. A writer with
a clock far in the future wins until real time catches up; that is inherent to LWW, and the
`writers` allow-list is the defence where it matters. Nothing compares these timestamps with
the reader's clock: the swarm's liveness dates records on the reader's own monotonic clock
(swarm_records.py, `Freshness`). Not here: I/O and verification policy
beyond the allow-list (`replica`).
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

from meshtrain.crdt.base import SignedCrdt
from meshtrain.crdt.entries import (
    INT_MAX,
    INT_MIN,
    MAX_OWNER_CHARS,
    MAX_SEQ,
    CrdtError,
    SignedEntry,
    check_value,
)
from meshtrain.transport.identity import Identity
from meshtrain.transport.validate import is_int, require_int, require_list, require_map

UINT64_MAX = INT_MAX
INT64_MIN, INT64_MAX = INT_MIN, (1 << 63) - 1
MAX_TIMESTAMP = INT64_MAX
MAX_KEY_CHARS = 1024


def now_ms() -> int:
    """Wall-clock milliseconds since the epoch: the default LWW timestamp."""
    return time.time_ns() // 1_000_000


def _lww_timestamp(requested: int | None, to_beat: int | None) -> int:
    if requested is not None:
        return require_int(requested, "timestamp", 0, MAX_TIMESTAMP, error=CrdtError)
    floor = 0 if to_beat is None else to_beat + 1
    return min(max(now_ms(), floor), MAX_TIMESTAMP)


class GCounter(SignedCrdt):
    """Grow-only counter. Body: the owner's running total, an int in 0..2**64-1.

    Value: the sum of all owners' totals. State: one small entry per owner.
    """

    type_tag: ClassVar[str] = "gcounter"

    @classmethod
    def check_body(cls, entry: SignedEntry) -> None:
        require_int(entry.body, "a GCounter total", 0, UINT64_MAX, error=CrdtError)

    def increment(self, identity: Identity, amount: int = 1) -> SignedEntry:
        require_int(amount, "increment amount", 0, UINT64_MAX, error=CrdtError)
        total = self.count_of(identity.peer_id_str) + amount
        if total > UINT64_MAX:
            raise CrdtError(f"GCounter total of {identity.peer_id_str} would exceed 2**64-1")
        return self._write(identity, total)

    def count_of(self, owner: str) -> int:
        entry = self._entries.get(owner)
        return 0 if entry is None else entry.body

    def counts(self) -> dict[str, int]:
        return {o: e.body for o, e in self._entries.items()}

    def value(self) -> int:
        return self._current_view()

    def _compute_view(self) -> int:
        return sum(e.body for e in self._entries.values())


class PNCounter(SignedCrdt):
    """Counter that can go down. Body: [increments, decrements], the owner's two running totals,
    each in 0..2**64-1.

    Value: sum over owners of increments - decrements. State: one small entry per owner.
    """

    type_tag: ClassVar[str] = "pncounter"

    @classmethod
    def check_body(cls, entry: SignedEntry) -> None:
        up, down = require_list(entry.body, "a PNCounter body", length=2, error=CrdtError)
        require_int(up, "PNCounter increments", 0, UINT64_MAX, error=CrdtError)
        require_int(down, "PNCounter decrements", 0, UINT64_MAX, error=CrdtError)

    def _totals(self, owner: str) -> tuple[int, int]:
        entry = self._entries.get(owner)
        return (0, 0) if entry is None else (entry.body[0], entry.body[1])

    def increment(self, identity: Identity, amount: int = 1) -> SignedEntry:
        require_int(amount, "increment amount", 0, UINT64_MAX, error=CrdtError)
        up, down = self._totals(identity.peer_id_str)
        if up + amount > UINT64_MAX:
            raise CrdtError("PNCounter increments would exceed 2**64-1")
        return self._write(identity, [up + amount, down])

    def decrement(self, identity: Identity, amount: int = 1) -> SignedEntry:
        require_int(amount, "decrement amount", 0, UINT64_MAX, error=CrdtError)
        up, down = self._totals(identity.peer_id_str)
        if down + amount > UINT64_MAX:
            raise CrdtError("PNCounter decrements would exceed 2**64-1")
        return self._write(identity, [up, down + amount])

    def count_of(self, owner: str) -> int:
        up, down = self._totals(owner)
        return up - down

    def value(self) -> int:
        return self._current_view()

    def _compute_view(self) -> int:
        return sum(e.body[0] - e.body[1] for e in self._entries.values())


class MaxRegister(SignedCrdt):
    """Per-owner monotone value, e.g. each peer's training step. Body: an int64.

    Value: the map owner -> value. `publish` refuses to go backwards, so an honest owner's latest
    entry is also its maximum; an owner that signs a lower value with a higher seq only lowers its
    own entry (nobody else's). State: one small entry per owner.
    """

    type_tag: ClassVar[str] = "maxregister"

    @classmethod
    def check_body(cls, entry: SignedEntry) -> None:
        require_int(entry.body, "a MaxRegister value", INT64_MIN, INT64_MAX, error=CrdtError)

    def publish(self, identity: Identity, value: int) -> SignedEntry:
        require_int(value, "MaxRegister value", INT64_MIN, INT64_MAX, error=CrdtError)
        current = self.get(identity.peer_id_str)
        if current is not None and value < current:
            raise CrdtError(f"MaxRegister values only grow: {value} < current {current}")
        return self._write(identity, value)

    def get(self, owner: str) -> int | None:
        entry = self._entries.get(owner)
        return None if entry is None else entry.body

    def value(self) -> dict[str, int]:
        return dict(self._current_view())

    def _compute_view(self) -> dict[str, int]:
        return {o: e.body for o, e in self._entries.items()}


class LWWRegister(SignedCrdt):
    """One value, last writer wins. Body: [timestamp, value] with any msgpack value.

    Value: the value of the entry with the largest (timestamp, owner), or None if nobody wrote.
    State: each writer's latest write (one entry per writer).
    Returned values are shared with the state: do not mutate them.
    """

    type_tag: ClassVar[str] = "lwwregister"

    @classmethod
    def check_body(cls, entry: SignedEntry) -> None:
        timestamp, _ = require_list(entry.body, "an LWWRegister body", length=2, error=CrdtError)
        require_int(timestamp, "LWWRegister timestamp", 0, MAX_TIMESTAMP, error=CrdtError)

    def set(self, identity: Identity, value: Any, *, timestamp: int | None = None) -> SignedEntry:
        check_value(value, what="LWWRegister value")
        winner = self.winner()
        ts = _lww_timestamp(timestamp, None if winner is None else winner.body[0])
        return self._write(identity, [ts, value])

    def winner(self) -> SignedEntry | None:
        return self._current_view()

    def timestamp(self) -> int | None:
        winner = self.winner()
        return None if winner is None else winner.body[0]

    def value(self) -> Any:
        winner = self.winner()
        return None if winner is None else winner.body[1]

    def _compute_view(self) -> SignedEntry | None:
        if not self._entries:
            return None
        return max(self._entries.values(), key=lambda e: (e.body[0], e.owner))


class LWWMap(SignedCrdt):
    """Map of str keys to values, last writer wins per key, deletes included.

    Body: the owner's writes, {key: [timestamp, value]} for a set or {key: [timestamp]} for a
    delete. Value: for each key, the write with the largest (timestamp, owner) over all owners;
    the key is absent if that write is a delete.

    Growth: an owner's body keeps every key it ever wrote, deletes as tombstones. Dropping a
    tombstone is not safe: a replica that still holds another owner's older write of that key
    would show it again. Keep an owner's key set small and stable (config, per-peer metrics).
    Returned values are shared with the state: do not mutate them.
    """

    type_tag: ClassVar[str] = "lwwmap"

    @classmethod
    def check_body(cls, entry: SignedEntry) -> None:
        for key, write in require_map(entry.body, what="an LWWMap body", error=CrdtError).items():
            _check_key(key)
            if not isinstance(write, list) or len(write) not in (1, 2):
                raise CrdtError("an LWWMap write is [timestamp, value] or [timestamp]")
            require_int(write[0], "LWWMap timestamp", 0, MAX_TIMESTAMP, error=CrdtError)

    def set(self, identity: Identity, key: str, value: Any, *, timestamp: int | None = None) -> SignedEntry:
        _check_key(key)
        check_value(value, what="LWWMap value")
        return self._write_key(identity, key, [value], timestamp)

    def delete(self, identity: Identity, key: str, *, timestamp: int | None = None) -> SignedEntry:
        """Delete `key` (a tombstone; wins over writes with a smaller (timestamp, owner))."""
        _check_key(key)
        return self._write_key(identity, key, [], timestamp)

    def _write_key(self, identity: Identity, key: str, value: list[Any], requested: int | None) -> SignedEntry:
        winner = self._current_view().get(key)
        ts = _lww_timestamp(requested, None if winner is None else winner[0])
        own = self._own_entry(identity)
        body = dict(own.body) if own is not None else {}
        body[key] = [ts, *value]
        return self._write(identity, body)

    def get(self, key: str, default: Any = None) -> Any:
        winner = self._current_view().get(key)
        if winner is None or len(winner[2]) == 1:
            return default
        return winner[2][1]

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        winner = self._current_view().get(key)
        return winner is not None and len(winner[2]) == 2

    def value(self) -> dict[str, Any]:
        return {k: w[2][1] for k, w in sorted(self._current_view().items()) if len(w[2]) == 2}

    def _compute_view(self) -> dict[str, tuple[int, str, list[Any]]]:
        # key -> (timestamp, owner, write) of the winning write, deletes included
        best: dict[str, tuple[int, str, list[Any]]] = {}
        for owner, entry in self._entries.items():
            for key, write in entry.body.items():
                held = best.get(key)
                if held is None or (write[0], owner) > (held[0], held[1]):
                    best[key] = (write[0], owner, write)
        return best


def _check_key(key: Any) -> None:
    if not isinstance(key, str) or len(key) > MAX_KEY_CHARS:
        raise CrdtError(f"an LWWMap key must be a str of at most {MAX_KEY_CHARS} characters")


def _check_element(element: Any) -> None:
    # Hashable scalars only, so the value is a frozenset; no bool (True == 1 in a set, but they
    # encode differently) and no float (NaN != NaN).
    if not (is_int(element) or isinstance(element, str | bytes)):
        raise CrdtError(f"an ORSet element must be a str, bytes or int, got {element!r:.40}")
    if isinstance(element, int) and not INT_MIN <= element <= INT_MAX:
        raise CrdtError("an ORSet integer element must be in msgpack's range")


class ORSet(SignedCrdt):
    """Observed-remove set: an add wins over a remove that did not see it.

    Every add is tagged (owner, seq) with the seq of the entry that made it. A remove takes away
    the tags of the element its author has observed; an add concurrent with the remove has a tag
    the remover never saw, so it survives.

    Body: [adds, removes] — adds {tag: element} are the owner's live adds; removes
    {other_owner: [tag, ...]} are tombstones for other owners' adds it removed. Removing one's own
    add just drops it from one's adds (no tombstone), and a write also drops the owner's adds that
    someone else has removed.

    Growth: adds are bounded by the owner's live elements; tombstones grow with the number of
    *other* owners' adds an owner has removed and are never compacted: forgetting one is safe only
    once every replica holds the add's owner's entry without that tag, which a pure data type
    cannot know. Fine for membership (a peer adds itself, leaves by removing itself, and others
    remove only the dead).

    Tags are unique per owner only while the owner keeps its state: an owner that lost it and
    writes again reuses seqs, so an old tombstone may hide its new add with a reused tag (see
    `base.py`: pull your own entry before writing after a restart).
    """

    type_tag: ClassVar[str] = "orset"

    @classmethod
    def check_body(cls, entry: SignedEntry) -> None:
        adds, removes = require_list(entry.body, "an ORSet body", length=2, error=CrdtError)
        for tag, element in require_map(adds, what="ORSet adds", error=CrdtError).items():
            # A tag is the seq of the owner's entry that made the add: never later than this one.
            require_int(tag, "ORSet add tag", 1, entry.seq, error=CrdtError)
            _check_element(element)
        for owner, tags in require_map(removes, what="ORSet removes", error=CrdtError).items():
            if not isinstance(owner, str) or not 0 < len(owner) <= MAX_OWNER_CHARS:
                raise CrdtError("ORSet removes are keyed by owner peer id")
            if not isinstance(tags, list):
                raise CrdtError("ORSet removed tags must be an array")
            for tag in tags:
                require_int(tag, "ORSet removed tag", 1, MAX_SEQ, error=CrdtError)

    def add(self, identity: Identity, element: str | bytes | int) -> SignedEntry:
        _check_element(element)
        own = self._own_entry(identity)
        adds, removes = self._own_parts(identity)
        # Re-adding replaces our previous tag for the element: one live tag per element per owner.
        adds = {t: e for t, e in adds.items() if e != element}
        adds[1 if own is None else own.seq + 1] = element
        return self._write(identity, self._body(adds, removes))

    def remove(self, identity: Identity, element: str | bytes | int) -> SignedEntry | None:
        """Remove the element's observed adds; None (and no write) if it is not in the set."""
        _check_element(element)
        observed = self._current_view()[0].get(element)
        if not observed:
            return None
        me = identity.peer_id_str
        adds, removes = self._own_parts(identity)
        for owner, tag in observed:
            if owner == me:
                adds.pop(tag, None)
            else:
                removes.setdefault(owner, set()).add(tag)
        return self._write(identity, self._body(adds, removes))

    def _own_parts(self, identity: Identity) -> tuple[dict[int, Any], dict[str, set[int]]]:
        own = self._own_entry(identity)
        if own is None:
            return {}, {}
        removed = self._current_view()[1]
        me = identity.peer_id_str
        adds = {t: e for t, e in own.body[0].items() if (me, t) not in removed}
        removes = {o: set(tags) for o, tags in own.body[1].items()}
        return adds, removes

    @staticmethod
    def _body(adds: dict[int, Any], removes: dict[str, set[int]]) -> list[Any]:
        return [adds, {o: sorted(tags) for o, tags in removes.items() if tags}]

    def __contains__(self, element: object) -> bool:
        if not (is_int(element) or isinstance(element, str | bytes)):
            return False
        return element in self._current_view()[0]

    def value(self) -> frozenset[str | bytes | int]:
        return frozenset(self._current_view()[0])

    def tags(self, element: str | bytes | int) -> list[tuple[str, int]]:
        """The live (owner, tag) adds of `element`, sorted."""
        return sorted(self._current_view()[0].get(element, ()))

    def _compute_view(self) -> tuple[dict[Any, list[tuple[str, int]]], set[tuple[str, int]]]:
        # (element -> its live (owner, tag) adds, every removed (owner, tag)). Elements are str,
        # bytes or int, which never compare equal across types, so they key a dict as they are.
        removed = {
            (owner, tag) for entry in self._entries.values() for owner, tags in entry.body[1].items() for tag in tags
        }
        live: dict[Any, list[tuple[str, int]]] = {}
        for owner, entry in self._entries.items():
            for tag, element in entry.body[0].items():
                if (owner, tag) not in removed:
                    live.setdefault(element, []).append((owner, tag))
        return live, removed


CRDT_TYPES: dict[str, type[SignedCrdt]] = {
    cls.type_tag: cls for cls in (GCounter, PNCounter, MaxRegister, LWWRegister, LWWMap, ORSet)
}
"""type tag -> class, for a replica that builds CRDTs from a swarm spec or a decoded batch."""
