"""DHT records as a specification: what is signed, what is refused, how a storing node merges.

Pure tests (no network). Signatures are real Ed25519; hypothesis draws record histories from a
few owners, subkeys and expiries so that ties and replacements are common.
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshtrain.dht.records import (
    InvalidRecord,
    Record,
    RecordLimits,
    RecordStore,
    as_state,
    live,
    merge,
    plain_or_dict,
    validate,
)
from meshtrain.transport.framing import packb, unpackb
from meshtrain.transport.identity import Identity

SWARM = "swarm-under-test"
KEY = "/meshtrain/swarm-under-test/peers"
NOW = 1_800_000_000.0
LIMITS = RecordLimits()
OWNERS = [Identity.generate() for _ in range(3)]
ALICE, BOB, CAROL = OWNERS

PROPERTY_SETTINGS = settings(
    max_examples=int(os.environ.get("MESHTRAIN_DHT_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def record(
    owner: Identity = ALICE,
    *,
    key: str = KEY,
    value: object = "v",
    expiry: float = NOW + 60,
    subkey: str | None | type = ...,
    swarm: str = SWARM,
) -> Record:
    sk = owner.peer_id_str if subkey is ... else subkey
    return Record.create(owner, swarm, key, value, expiry, sk)


def check(rec: Record) -> None:
    validate(rec, SWARM, now=NOW, limits=LIMITS)


def reason(rec: Record, limits: RecordLimits = LIMITS) -> str:
    with pytest.raises(InvalidRecord) as e:
        validate(rec, SWARM, now=NOW, limits=limits)
    return e.value.reason


# --- signing and validation -------------------------------------------------------------------


def test_a_signed_record_validates_and_survives_the_wire() -> None:
    rec = record(value={"addrs": ["/ip4/127.0.0.1/tcp/1"], "n": 3, "b": b"\x00"})
    check(rec)
    back = Record.from_wire(KEY, unpackb(packb(rec.to_wire())))
    assert back == rec
    check(back)
    assert back.decoded == {"addrs": ["/ip4/127.0.0.1/tcp/1"], "n": 3, "b": b"\x00"}


def test_value_encoding_does_not_depend_on_map_order() -> None:
    a = record(value={"x": 1, "y": 2})
    b = record(value={"y": 2, "x": 1})
    assert a.value == b.value and a.signature == b.signature


def test_integer_and_float_expiry_sign_the_same() -> None:
    rec = record(expiry=int(NOW) + 60)
    wire = rec.to_wire() | {"e": int(NOW) + 60}
    check(Record.from_wire(KEY, wire))


@pytest.mark.parametrize(
    "tamper",
    ["key", "subkey", "value", "expiry", "owner", "signature"],
)
def test_every_signed_field_is_covered(tamper: str) -> None:
    rec = record()
    changed = {
        "key": {"key": KEY + "x"},
        "subkey": {"subkey": ALICE.peer_id_str + "/other"},
        "value": {"value": packb("w")},
        "expiry": {"expiry": rec.expiry + 1},
        "owner": {"owner": BOB.peer_id_str, "subkey": BOB.peer_id_str},
        "signature": {"signature": bytes(64)},
    }[tamper]
    assert reason(dataclasses.replace(rec, **changed)) == "forged"


def test_a_record_signed_for_another_swarm_is_forged_here() -> None:
    assert reason(record(swarm="other-swarm")) == "forged"


def test_a_signature_moved_to_another_key_is_forged() -> None:
    other = record(key="/meshtrain/other/key")
    assert reason(dataclasses.replace(other, key=KEY)) == "forged"


def test_unsigned_records_are_refused() -> None:
    assert reason(dataclasses.replace(record(), signature=b"")) == "unsigned"
    assert Record.from_wire(KEY, record().to_wire() | {"g": None}).signature == b""


def test_expired_records_are_refused() -> None:
    assert reason(record(expiry=NOW - 1)) == "expired"
    assert reason(record(expiry=NOW)) == "expired"


def test_records_dated_beyond_max_ttl_plus_skew_are_refused() -> None:
    check(record(expiry=NOW + LIMITS.max_ttl + LIMITS.clock_skew - 1))
    assert reason(record(expiry=NOW + LIMITS.max_ttl + LIMITS.clock_skew + 1)) == "future"


def test_oversized_values_are_refused() -> None:
    check(record(value=b"x" * (LIMITS.max_value_bytes - 16)))
    assert reason(record(value=b"x" * LIMITS.max_value_bytes)) == "oversized"


def test_a_subkey_belongs_to_its_owner() -> None:
    check(record(ALICE, subkey=ALICE.peer_id_str))
    check(record(ALICE, subkey=ALICE.peer_id_str + "/stage-2"))
    check(record(ALICE, subkey=None))  # the plain value is anyone's
    assert reason(record(ALICE, subkey=BOB.peer_id_str)) == "not_owner"
    assert reason(record(ALICE, subkey="shared")) == "not_owner"


@pytest.mark.parametrize(
    "wire",
    [
        "not a map",
        {"s": None, "v": "str", "e": NOW + 1, "o": "x", "g": b"s"},
        {"s": None, "v": b"v", "e": True, "o": "x", "g": b"s"},
        {"s": None, "v": b"v", "e": "soon", "o": "x", "g": b"s"},
        {"s": 5, "v": b"v", "e": NOW + 1, "o": "x", "g": b"s"},
        {"s": None, "v": b"v", "e": NOW + 1, "o": "", "g": b"s"},
        {"s": None, "v": b"v", "e": NOW + 1, "o": "x", "g": "sig"},
    ],
)
def test_malformed_wire_records_are_refused(wire: object) -> None:
    with pytest.raises(InvalidRecord) as e:
        Record.from_wire(KEY, wire)
    assert e.value.reason == "malformed"


def test_a_non_finite_expiry_or_garbage_owner_is_refused() -> None:
    assert reason(dataclasses.replace(record(), expiry=float("nan"))) == "malformed"
    assert reason(dataclasses.replace(record(subkey=None), owner="not-a-peer-id")) == "forged"


def test_a_signed_value_that_is_not_msgpack_is_refused() -> None:
    from meshtrain.dht.records import signing_payload

    bad = b"\xc1"  # reserved msgpack byte
    sig = ALICE.sign(signing_payload(SWARM, KEY, None, bad, NOW + 5, ALICE.peer_id_str))
    rec = Record(KEY, None, bad, NOW + 5, ALICE.peer_id_str, sig)
    assert reason(rec) == "malformed"


# --- merge laws (hypothesis) ------------------------------------------------------------------

owners = st.sampled_from(OWNERS)
histories = st.lists(
    st.tuples(
        owners,
        st.sampled_from(["", "/a"]),  # suffix: two subkeys per owner
        st.booleans(),  # plain (subkey None) or owned subkey
        st.integers(1, 4),  # expiry offset: few values so ties are common
        st.integers(0, 2),  # value
    ),
    max_size=10,
)


def build(history: list) -> list[Record]:
    out = []
    for owner, suffix, plain, dt, v in history:
        sk = None if plain else owner.peer_id_str + suffix
        out.append(record(owner, subkey=sk, expiry=NOW + dt, value=v))
    return out


@PROPERTY_SETTINGS
@given(histories, histories, histories)
def test_merge_is_commutative_associative_and_idempotent(h1: list, h2: list, h3: list) -> None:
    a, b, c = (as_state(build(h)) for h in (h1, h2, h3))
    assert merge(a, b) == merge(b, a)
    assert merge(merge(a, b), c) == merge(a, merge(b, c))
    assert merge(a, a) == a
    assert merge(a, {}) == a


@PROPERTY_SETTINGS
@given(histories, st.randoms(use_true_random=False))
def test_a_storing_node_converges_whatever_the_arrival_order(h: list, rnd: random.Random) -> None:
    recs = build(h)
    shuffled = recs[:]
    rnd.shuffle(shuffled)
    one, two = RecordStore(SWARM), RecordStore(SWARM)
    for r in recs:
        one.put(r, NOW)
    for r in shuffled + shuffled:  # duplicates change nothing
        two.put(r, NOW)
    assert one.get(KEY, NOW) == two.get(KEY, NOW) == as_state(recs)


@PROPERTY_SETTINGS
@given(histories)
def test_per_subkey_the_latest_expiry_wins(h: list) -> None:
    recs = build(h)
    state = as_state(recs)
    for sk, winner in state.items():
        assert winner.expiry == max(r.expiry for r in recs if r.subkey == sk)


@PROPERTY_SETTINGS
@given(
    st.sampled_from(["key", "subkey", "value", "expiry", "owner", "signature", "swarm"]),
    st.binary(min_size=1, max_size=8),
)
def test_any_tampered_field_is_rejected(field: str, noise: bytes) -> None:
    rec = record(BOB, value=noise)
    if field == "swarm":
        with pytest.raises(InvalidRecord):
            validate(rec, SWARM + noise.hex(), now=NOW, limits=LIMITS)
        return
    if field == "key":
        rec = dataclasses.replace(rec, key=rec.key + noise.hex())
    elif field == "subkey":
        rec = dataclasses.replace(rec, subkey=BOB.peer_id_str + "/" + noise.hex())
    elif field == "value":
        rec = dataclasses.replace(rec, value=packb(noise + b"!"))
    elif field == "expiry":
        rec = dataclasses.replace(rec, expiry=rec.expiry + 1 + noise[0])
    elif field == "owner":
        rec = dataclasses.replace(rec, owner=CAROL.peer_id_str, subkey=CAROL.peer_id_str)
    else:
        sig = bytearray(rec.signature)
        sig[noise[0] % 64] ^= 1 + noise[-1] % 255
        rec = dataclasses.replace(rec, signature=bytes(sig))
    with pytest.raises(InvalidRecord):
        check(rec)


# --- the storing node -------------------------------------------------------------------------


def test_store_merges_subkeys_from_different_owners() -> None:
    store = RecordStore(SWARM)
    for owner in OWNERS:
        assert store.put(record(owner, value=owner.peer_id_str[-4:]), NOW)
    got = plain_or_dict(store.get(KEY, NOW))
    assert got == {o.peer_id_str: o.peer_id_str[-4:] for o in OWNERS}


def test_newer_expiry_replaces_and_older_is_ignored() -> None:
    store = RecordStore(SWARM)
    assert store.put(record(value="old", expiry=NOW + 10), NOW)
    assert store.put(record(value="new", expiry=NOW + 20), NOW)
    assert not store.put(record(value="stale", expiry=NOW + 15), NOW)
    assert not store.put(record(value="new", expiry=NOW + 20), NOW)
    assert plain_or_dict(store.get(KEY, NOW)) == {ALICE.peer_id_str: "new"}


def test_expired_entries_disappear_from_gets_and_purges() -> None:
    store = RecordStore(SWARM)
    store.put(record(ALICE, expiry=NOW + 5), NOW)
    store.put(record(BOB, expiry=NOW + 50), NOW)
    assert set(store.get(KEY, NOW + 10)) == {BOB.peer_id_str}
    assert store.purge(NOW + 100) == 1
    assert store.get(KEY, NOW + 100) == {} and len(store) == 0


def test_a_plain_key_returns_its_value() -> None:
    store = RecordStore(SWARM)
    store.put(record(ALICE, subkey=None, value=1, expiry=NOW + 5), NOW)
    store.put(record(BOB, subkey=None, value=2, expiry=NOW + 9), NOW)  # anyone may replace it
    assert plain_or_dict(store.get(KEY, NOW)) == 2
    assert plain_or_dict({}) is None
    assert live(store.get(KEY, NOW), NOW + 10) == {}


def test_store_refuses_invalid_records_and_keeps_its_state() -> None:
    store = RecordStore(SWARM)
    good = record()
    store.put(good, NOW)
    for bad in (
        dataclasses.replace(record(value="evil", expiry=NOW + 99), signature=bytes(64)),
        record(value="evil", expiry=NOW - 1),
        record(value="evil", swarm="other"),
        record(value=b"x" * LIMITS.max_value_bytes, expiry=NOW + 99),
    ):
        with pytest.raises(InvalidRecord):
            store.put(bad, NOW)
    assert store.get(KEY, NOW) == {ALICE.peer_id_str: good}


def test_a_key_is_bounded_in_subkeys_and_bytes() -> None:
    limits = RecordLimits(max_subkeys=2, max_key_bytes=1 << 20)
    store = RecordStore(SWARM, limits)
    store.put(record(ALICE), NOW)
    store.put(record(BOB), NOW)
    with pytest.raises(InvalidRecord) as e:
        store.put(record(CAROL), NOW)
    assert e.value.reason == "key_full"
    store.put(record(ALICE, value="replacing an existing subkey is fine", expiry=NOW + 70), NOW)

    small = RecordStore(SWARM, RecordLimits(max_key_bytes=1000))
    small.put(record(ALICE, value=b"x" * 400), NOW)
    with pytest.raises(InvalidRecord) as e:
        small.put(record(BOB, value=b"x" * 600), NOW)
    assert e.value.reason == "key_full"


def test_the_store_is_bounded_in_keys() -> None:
    store = RecordStore(SWARM, RecordLimits(max_keys=2))
    store.put(record(key="/a"), NOW)
    store.put(record(key="/b", expiry=NOW + 5), NOW)
    with pytest.raises(InvalidRecord) as e:
        store.put(record(key="/c"), NOW)
    assert e.value.reason == "store_full"
    store.put(record(key="/c"), NOW + 10)  # /b expired: room again
    assert sorted(store.keys()) == ["/a", "/c"]
