"""Property tests for every CRDT type: lattice laws, deltas, tampering, encoding, hostile input.

Histories are simulated with real Ed25519 signatures: several writers, each with its own replica,
write, sync with each other at random, and sometimes lose their state (so they write the same seq
twice: an equivocation merge must resolve deterministically). States under test are built from
random subsets of all entries ever written.
"""

from __future__ import annotations

import contextlib
import os
import random

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshtrain.crdt.base import SignedCrdt
from meshtrain.crdt.entries import (
    CrdtError,
    EntryScope,
    SignedEntry,
    digest_from_wire,
    digest_to_wire,
    entries_from_wire,
    sign_entry,
)
from meshtrain.crdt.types import (
    CRDT_TYPES,
    GCounter,
    LWWMap,
    LWWRegister,
    MaxRegister,
    ORSet,
    PNCounter,
)
from meshtrain.transport.framing import packb, unpackb
from meshtrain.transport.identity import Identity

IDENTITIES = [Identity.generate() for _ in range(4)]  # once per module: examples reuse them
BY_PEER_ID = {i.peer_id_str: i for i in IDENTITIES}
NS, NAME = "swarm-under-test", "crdt-under-test"
TYPES = list(CRDT_TYPES.values())

# Kept small so the suite runs in seconds on a shared 2-core box; raise it for a deeper run:
# MESHTRAIN_CRDT_EXAMPLES=500 pytest tests/test_crdt_properties.py
PROPERTY_SETTINGS = settings(
    max_examples=int(os.environ.get("MESHTRAIN_CRDT_EXAMPLES", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# --- strategies -------------------------------------------------------------------------------

timestamps = st.one_of(st.none(), st.integers(0, 3))  # small range: LWW ties are common
elements = st.sampled_from(["a", "b", "c", b"a", 1])
keys = st.sampled_from(["lr", "batch", "model"])
small_values = st.one_of(st.integers(-3, 3), st.text(max_size=3), st.lists(st.integers(0, 2), max_size=2))

packable_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=6),
    st.binary(max_size=6),
)
packable_values = st.recursive(
    packable_scalars,
    lambda kids: (
        st.lists(kids, max_size=4)
        | st.dictionaries(st.one_of(st.text(max_size=4), st.integers(-5, 5)), kids, max_size=4)
    ),
    max_leaves=12,
)


def write_op(data: st.DataObject, replica: SignedCrdt, identity: Identity) -> SignedEntry | None:
    """One random mutation of `replica` by `identity`; returns the delta it produced."""
    if isinstance(replica, GCounter):
        return replica.increment(identity, data.draw(st.integers(0, 5)))
    if isinstance(replica, PNCounter):
        amount = data.draw(st.integers(0, 5))
        if data.draw(st.booleans()):
            return replica.increment(identity, amount)
        return replica.decrement(identity, amount)
    if isinstance(replica, MaxRegister):
        current = replica.get(identity.peer_id_str) or 0
        return replica.publish(identity, current + data.draw(st.integers(0, 3)))
    if isinstance(replica, LWWRegister):
        return replica.set(identity, data.draw(small_values), timestamp=data.draw(timestamps))
    if isinstance(replica, LWWMap):
        key, ts = data.draw(keys), data.draw(timestamps)
        if data.draw(st.integers(0, 3)) == 0:
            return replica.delete(identity, key, timestamp=ts)
        return replica.set(identity, key, data.draw(small_values), timestamp=ts)
    if isinstance(replica, ORSet):
        element = data.draw(elements)
        if data.draw(st.booleans()):
            return replica.add(identity, element)
        return replica.remove(identity, element)
    raise AssertionError(f"no operations defined for {type(replica).__name__}")


def simulate(
    data: st.DataObject, cls: type[SignedCrdt], max_ops: int = 12
) -> tuple[list[SignedCrdt], list[SignedEntry]]:
    """Writers write, sync and lose state at random. Returns (every replica state that ever
    existed, the deltas written)."""
    replicas = [cls(NS, NAME) for _ in IDENTITIES]
    retired: list[SignedCrdt] = []
    deltas: list[SignedEntry] = []
    for _ in range(data.draw(st.integers(1, max_ops))):
        w = data.draw(st.integers(0, len(IDENTITIES) - 1))
        action = data.draw(st.sampled_from(["write"] * 4 + ["sync"] * 2 + ["lose_state"]))
        if action == "sync":
            replicas[w].merge(replicas[data.draw(st.integers(0, len(IDENTITIES) - 1))])
        elif action == "lose_state":
            retired.append(replicas[w])
            replicas[w] = cls(NS, NAME)  # its next write reuses seq 1: an equivocation
        else:
            entry = write_op(data, replicas[w], IDENTITIES[w])
            if entry is not None:
                deltas.append(entry)
    return replicas + retired, deltas


def state_of(cls: type[SignedCrdt], entries: list[SignedEntry]) -> SignedCrdt:
    state = cls(NS, NAME)
    outcome = state.apply(entries)
    assert not outcome.rejected
    return state


def random_state(data: st.DataObject, cls: type[SignedCrdt], pool: list[SignedEntry]) -> SignedCrdt:
    picked = data.draw(st.lists(st.sampled_from(pool), max_size=len(pool))) if pool else []
    return state_of(cls, picked)


def merged(*states: SignedCrdt) -> SignedCrdt:
    out = states[0].copy()
    for s in states[1:]:
        out.merge(s)
    return out


def assert_same_state(a: SignedCrdt, b: SignedCrdt) -> None:
    assert a == b
    assert a.to_bytes() == b.to_bytes()
    assert a.value() == b.value()


# --- lattice laws --------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", TYPES, ids=lambda c: c.__name__)
@PROPERTY_SETTINGS
@given(data=st.data())
def test_merge_is_commutative_associative_idempotent_and_inflationary(cls, data):
    _, pool = simulate(data, cls)
    a, b, c = (random_state(data, cls, pool) for _ in range(3))

    assert_same_state(merged(a, b), merged(b, a))
    assert_same_state(merged(merged(a, b), c), merged(a, merged(b, c)))
    assert_same_state(merged(a, a), a)
    assert_same_state(merged(merged(a, b), b), merged(a, b))
    ab = merged(a, b)
    assert a <= ab and b <= ab
    assert ab.version_vector().keys() >= a.version_vector().keys() | b.version_vector().keys()
    assert all(ab.version_vector()[o] >= s for o, s in a.version_vector().items())


@pytest.mark.parametrize("cls", TYPES, ids=lambda c: c.__name__)
@PROPERTY_SETTINGS
@given(data=st.data())
def test_deltas_in_any_order_with_duplicates_equal_the_full_state_merge(cls, data):
    states, deltas = simulate(data, cls)
    full = merged(*states)

    shuffled = deltas + data.draw(st.lists(st.sampled_from(deltas), max_size=5) if deltas else st.just([]))
    random.Random(data.draw(st.integers(0, 2**32))).shuffle(shuffled)
    from_deltas = cls(NS, NAME)
    for i in range(0, len(shuffled), 3):  # delivered in small batches
        from_deltas.apply(shuffled[i : i + 3])
    assert_same_state(from_deltas, full)


@pytest.mark.parametrize("cls", TYPES, ids=lambda c: c.__name__)
@PROPERTY_SETTINGS
@given(data=st.data())
def test_anti_entropy_delta_since_digest_brings_replica_to_the_merge(cls, data):
    _, pool = simulate(data, cls)
    mine, theirs = random_state(data, cls, pool), random_state(data, cls, pool)

    wire_digest = digest_from_wire(unpackb(packb(digest_to_wire(mine.digest()))))
    delta = theirs.delta_since(wire_digest)
    caught_up = mine.copy()
    caught_up.apply(cls.decode_entries(theirs.encode_entries(delta)))
    assert_same_state(caught_up, merged(mine, theirs))
    # Nothing more to send once caught up.
    assert theirs.delta_since(caught_up.digest()) == []
    # A plain version vector never asks for less than the entries with higher seqs.
    vv_delta = theirs.delta_since(mine.version_vector())
    assert set(vv_delta) <= set(delta)


# --- tampering ------------------------------------------------------------------------------------

TAMPERINGS = [
    "flip_signature",
    "swap_body",
    "flip_body_byte",
    "change_owner",
    "other_namespace",
    "other_crdt_name",
    "other_type",
]


def tampered(data: st.DataObject, cls: type[SignedCrdt], entry: SignedEntry, pool: list[SignedEntry]):
    how = data.draw(st.sampled_from(TAMPERINGS))
    owner_identity = BY_PEER_ID[entry.owner]
    if how == "flip_signature":
        i, mask = data.draw(st.integers(0, 63)), data.draw(st.integers(1, 255))
        sig = bytearray(entry.signature)
        sig[i] ^= mask
        return SignedEntry(entry.owner, entry.seq, entry.body, bytes(sig))
    if how == "swap_body":
        others = [e.body for e in pool if e.body_bytes != entry.body_bytes]
        if others:
            return SignedEntry(entry.owner, entry.seq, data.draw(st.sampled_from(others)), entry.signature)
        how = "flip_body_byte"
    if how == "flip_body_byte":
        raw = bytearray(entry.body_bytes)
        i, mask = data.draw(st.integers(0, len(raw) - 1)), data.draw(st.integers(1, 255))
        raw[i] ^= mask
        try:
            body = msgpack.unpackb(bytes(raw), raw=False, strict_map_key=False)
            wire = entries_from_wire([[entry.owner, entry.seq, body, entry.signature]])[0]
        except Exception:  # an undecodable flip is not a tampered *entry*: forge a body
            body = {"tampered": True}
            wire = SignedEntry(entry.owner, entry.seq, body, entry.signature)
        if wire.body_bytes == entry.body_bytes:  # the flip happened to give the same body
            wire = SignedEntry(entry.owner, entry.seq, {"tampered": True}, entry.signature)
        return wire
    if how == "change_owner":
        other = data.draw(st.sampled_from([i for i in IDENTITIES if i.peer_id_str != entry.owner]))
        return SignedEntry(other.peer_id_str, entry.seq, entry.body, entry.signature)
    scope = {
        "other_namespace": EntryScope("another-swarm", NAME, cls.type_tag),
        "other_crdt_name": EntryScope(NS, "another-crdt", cls.type_tag),
        "other_type": EntryScope(NS, NAME, "another-type"),
    }[how]
    return sign_entry(owner_identity, scope, entry.seq, entry.body)


@pytest.mark.parametrize("cls", TYPES, ids=lambda c: c.__name__)
@PROPERTY_SETTINGS
@given(data=st.data())
def test_tampered_entries_are_rejected_and_leave_state_unchanged(cls, data):
    _, pool = simulate(data, cls)
    if not pool:
        return
    state = random_state(data, cls, pool)
    forged = tampered(data, cls, data.draw(st.sampled_from(pool)), pool)

    before = state.to_bytes()
    outcome = state.apply([forged])
    assert outcome.accepted == ()
    assert state.to_bytes() == before

    # Where the forgery would have changed the state it is checked and reported.
    empty = cls(NS, NAME)
    outcome = empty.apply([forged])
    assert outcome.accepted == () and [r.entry for r in outcome.rejected] == [forged]
    assert len(empty) == 0


@pytest.mark.parametrize("cls", TYPES, ids=lambda c: c.__name__)
@PROPERTY_SETTINGS
@given(data=st.data())
def test_flipping_any_byte_of_an_encoded_delta_never_smuggles_in_a_new_entry(cls, data):
    _, pool = simulate(data, cls, max_ops=4)
    if not pool:
        return
    entry = data.draw(st.sampled_from(pool))
    raw = bytearray(cls(NS, NAME).encode_entries([entry]))
    raw[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
    try:
        decoded = cls.decode_entries(bytes(raw))
    except CrdtError:
        return
    outcome = cls(NS, NAME).apply(decoded)
    assert all(e == entry for e in outcome.accepted)


@pytest.mark.parametrize("cls", TYPES, ids=lambda c: c.__name__)
@PROPERTY_SETTINGS
@given(data=st.data())
def test_entries_from_a_writer_outside_the_allow_list_are_rejected(cls, data):
    _, pool = simulate(data, cls)
    allowed = {IDENTITIES[0].peer_id_str}
    guarded = cls(NS, NAME, writers=allowed)
    outcome = guarded.apply(pool)
    assert set(guarded.owners()) <= allowed
    assert all(r.entry.owner not in allowed for r in outcome.rejected)
    assert_same_state_entries(guarded, state_of(cls, [e for e in pool if e.owner in allowed]))


def assert_same_state_entries(a: SignedCrdt, b: SignedCrdt) -> None:
    assert a.entries() == b.entries() and a.to_bytes() == b.to_bytes()


# --- encoding -------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", TYPES, ids=lambda c: c.__name__)
@PROPERTY_SETTINGS
@given(data=st.data())
def test_encoding_round_trips_and_is_canonical(cls, data):
    _, pool = simulate(data, cls)
    picked = data.draw(st.lists(st.sampled_from(pool), max_size=len(pool))) if pool else []
    one = state_of(cls, picked)
    reordered = list(reversed(picked))
    other = state_of(cls, reordered)

    encoded = one.to_bytes()
    assert other.to_bytes() == encoded  # same state, built in another order: same bytes
    decoded = cls.from_bytes(encoded, NS, NAME)
    assert_same_state(decoded, one)
    assert decoded.to_bytes() == encoded


# --- hostile input --------------------------------------------------------------------------------

NEAR_VALID_BODIES = {
    "gcounter": st.integers(-5, 2**64 - 1),
    "pncounter": st.lists(st.integers(-2, 2**64 - 1), max_size=3),
    "maxregister": st.integers(-(2**63), 2**63),
    "lwwregister": st.lists(st.one_of(st.integers(-1, 2**63), packable_values), max_size=3),
    "lwwmap": st.dictionaries(
        st.one_of(st.text(max_size=3), st.integers(0, 3)),
        st.one_of(st.lists(st.one_of(st.integers(-1, 5), packable_values), max_size=3), packable_values),
        max_size=3,
    ),
    "orset": st.lists(
        st.one_of(
            st.dictionaries(
                st.one_of(st.integers(-1, 6), st.text(max_size=2)),
                st.one_of(elements, packable_values),
                max_size=3,
            ),
            st.dictionaries(
                st.one_of(st.sampled_from(list(BY_PEER_ID)), st.integers()),
                st.one_of(st.lists(st.integers(-1, 6), max_size=3), packable_values),
                max_size=2,
            ),
            packable_values,
        ),
        max_size=3,
    ),
}


@pytest.mark.parametrize("cls", TYPES, ids=lambda c: c.__name__)
@PROPERTY_SETTINGS
@given(data=st.data())
def test_validly_signed_junk_bodies_are_rejected_or_usable_never_crash(cls, data):
    """An owner may sign anything; the type's rules must reject it or the value must be readable."""
    body = data.draw(st.one_of(NEAR_VALID_BODIES[cls.type_tag], packable_values))
    identity = data.draw(st.sampled_from(IDENTITIES))
    seq = data.draw(st.integers(1, 6))
    try:
        entry = sign_entry(identity, EntryScope(NS, NAME, cls.type_tag), seq, body)
    except CrdtError:  # not even encodable (e.g. an int beyond msgpack's range): nothing to send
        return
    state = cls(NS, NAME)
    outcome = state.apply([entry])
    if outcome.accepted:
        state.value()
        assert_same_state(cls.from_bytes(state.to_bytes(), NS, NAME), state)
    else:
        assert outcome.rejected[0].reason.startswith("malformed entry")


@settings(max_examples=200, deadline=None)
@given(cls=st.sampled_from(TYPES), garbage=st.binary(max_size=200))
def test_decoding_random_bytes_raises_only_crdt_error(cls, garbage):
    with contextlib.suppress(CrdtError):
        cls.from_bytes(garbage, NS, NAME)


@settings(max_examples=200, deadline=None)
@given(
    cls=st.sampled_from(TYPES),
    value=st.one_of(
        packable_values,
        st.tuples(st.just(1), st.sampled_from(list(CRDT_TYPES)), st.lists(packable_values, max_size=3)).map(list),
        st.tuples(
            st.just(1),
            st.sampled_from(list(CRDT_TYPES)),
            st.lists(
                st.tuples(
                    st.one_of(st.sampled_from(list(BY_PEER_ID)), packable_values),
                    st.one_of(st.integers(0, 3), packable_values),
                    packable_values,
                    st.one_of(st.binary(min_size=64, max_size=64), packable_values),
                ).map(list),
                max_size=3,
            ),
        ).map(list),
    ),
)
def test_decoding_structured_garbage_raises_only_crdt_error(cls, value):
    encoded = packb(value)
    with contextlib.suppress(CrdtError):
        cls.from_bytes(encoded, NS, NAME)
    with contextlib.suppress(CrdtError):
        cls(NS, NAME).apply(cls.decode_entries(encoded))


@settings(max_examples=100, deadline=None)
@given(value=packable_values | st.dictionaries(st.text(max_size=4), packable_values, max_size=3))
def test_decoding_a_garbage_digest_raises_only_crdt_error(value):
    try:
        digest = digest_from_wire(value)
    except CrdtError:
        return
    GCounter(NS, NAME).delta_since(digest)  # a digest that decodes is usable
