"""Value semantics of each CRDT type, and the signing, caching and encoding rules they share."""

from __future__ import annotations

import msgpack
import pytest

from meshtrain.crdt.entries import (
    SIGNATURE_BYTES,
    CrdtError,
    EntryScope,
    MalformedCrdtData,
    NotAWriter,
    RejectedEntries,
    SignatureCache,
    SignedEntry,
    digest_from_wire,
    sign_entry,
    verify_entry,
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
from meshtrain.transport.identity import Identity

# Sorted by peer id, so LWW tie-breaks (larger peer id wins) are predictable.
ALICE, BOB, CAROL = sorted((Identity.generate() for _ in range(3)), key=lambda i: i.peer_id_str)
NS = "swarm-1"


def replicas(cls, n=2, **kwargs):
    return [cls(NS, "x", **kwargs) for _ in range(n)]


def sync(*states):
    """Full exchange among states, as anti-entropy would end up doing."""
    for a in states:
        for b in states:
            if a is not b:
                a.merge(b)


# --- counters and registers -----------------------------------------------------------------------


def test_gcounter_value_is_the_sum_of_every_owners_total():
    a, b = replicas(GCounter)
    a.increment(ALICE, 3)
    a.increment(ALICE)
    b.increment(BOB, 10)
    sync(a, b)
    assert a.value() == b.value() == 14
    assert a.counts() == {ALICE.peer_id_str: 4, BOB.peer_id_str: 10}
    assert len(a) == 2  # one entry per owner however many increments


def test_gcounter_refuses_negative_and_non_int_increments():
    counter = GCounter(NS, "x")
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(CrdtError):
            counter.increment(ALICE, bad)
    assert counter.value() == 0 and len(counter) == 0


def test_pncounter_value_can_go_below_zero():
    a, b = replicas(PNCounter)
    a.increment(ALICE, 5)
    a.decrement(ALICE, 2)
    b.decrement(BOB, 7)
    sync(a, b)
    assert a.value() == b.value() == -4
    assert a.count_of(ALICE.peer_id_str) == 3


def test_max_register_maps_each_owner_to_its_latest_value_and_refuses_to_go_back():
    a, b = replicas(MaxRegister)
    a.publish(ALICE, 10)
    a.publish(ALICE, 12)
    b.publish(BOB, 3)
    with pytest.raises(CrdtError, match="only grow"):
        a.publish(ALICE, 11)
    sync(a, b)
    assert a.value() == b.value() == {ALICE.peer_id_str: 12, BOB.peer_id_str: 3}
    assert a.get(CAROL.peer_id_str) is None


def test_lww_register_later_timestamp_wins_and_ties_go_to_the_larger_peer_id():
    a, b = replicas(LWWRegister)
    a.set(ALICE, "old", timestamp=5)
    b.set(BOB, "new", timestamp=6)
    sync(a, b)
    assert a.value() == b.value() == "new"

    c, d = replicas(LWWRegister)
    c.set(ALICE, "alice", timestamp=7)
    d.set(BOB, "bob", timestamp=7)
    sync(c, d)
    assert c.value() == d.value() == "bob"  # BOB's peer id sorts after ALICE's
    assert c.winner().owner == BOB.peer_id_str


def test_lww_register_write_after_seeing_a_value_supersedes_it_even_with_a_slow_clock():
    a, b = replicas(LWWRegister)
    far_future = 2**62
    a.set(ALICE, "from the future", timestamp=far_future)
    b.merge(a)
    b.set(BOB, "seen it, replacing it")  # no explicit timestamp: max(now, winner + 1)
    assert b.value() == "seen it, replacing it"
    assert b.timestamp() == far_future + 1


def test_lww_register_is_none_until_written():
    assert LWWRegister(NS, "x").value() is None


# --- LWWMap -------------------------------------------------------------------------------------


def test_lww_map_set_get_delete():
    config = LWWMap(NS, "config")
    config.set(ALICE, "lr", 0.1, timestamp=1)
    config.set(ALICE, "batch", 32, timestamp=1)
    config.delete(ALICE, "batch", timestamp=2)
    assert config.value() == {"lr": 0.1}
    assert config.get("batch", "default") == "default"
    assert "lr" in config and "batch" not in config and 3 not in config
    assert len(config) == 1  # one owner, one entry holding both keys


def test_lww_map_resolves_each_key_independently_by_timestamp_then_peer_id():
    a, b = replicas(LWWMap)
    a.set(ALICE, "k1", "alice", timestamp=10)
    a.set(ALICE, "k2", "alice", timestamp=10)
    b.set(BOB, "k1", "bob", timestamp=9)
    b.set(BOB, "k2", "bob", timestamp=10)  # tie on k2: larger peer id wins
    sync(a, b)
    assert a.value() == b.value() == {"k1": "alice", "k2": "bob"}


def test_lww_map_delete_wins_over_an_older_write_and_loses_to_a_newer_one():
    a, b = replicas(LWWMap)
    a.set(ALICE, "k", "v", timestamp=1)
    b.merge(a)
    b.delete(BOB, "k", timestamp=2)
    sync(a, b)
    assert "k" not in a and "k" not in b
    a.set(ALICE, "k", "again", timestamp=3)
    sync(a, b)
    assert a.get("k") == b.get("k") == "again"


def test_lww_map_with_writers_accepts_only_the_swarm_owner():
    owner_only = {ALICE.peer_id_str}
    mine = LWWMap(NS, "config", writers=owner_only)
    mine.set(ALICE, "lr", 0.1)
    with pytest.raises(NotAWriter):
        mine.set(BOB, "lr", 99.0)

    open_map = LWWMap(NS, "config")
    forged_by_peer = open_map.set(BOB, "lr", 99.0, timestamp=2**62)
    outcome = mine.apply([forged_by_peer])
    assert outcome.accepted == () and "allowed writer" in outcome.rejected[0].reason
    assert mine.get("lr") == 0.1


# --- ORSet --------------------------------------------------------------------------------------


def test_or_set_add_wins_over_a_concurrent_remove():
    a, b = replicas(ORSet)
    a.add(ALICE, "peer-x")
    b.merge(a)
    b.remove(BOB, "peer-x")  # BOB saw ALICE's first add only
    a.add(ALICE, "peer-x")  # concurrently, ALICE adds it again (a new tag BOB never saw)
    sync(a, b)
    assert a.value() == b.value() == {"peer-x"}


def test_or_set_remove_of_observed_adds_removes_from_every_owner():
    a, b, c = replicas(ORSet, 3)
    a.add(ALICE, "x")
    b.add(BOB, "x")
    c.merge(a)
    c.merge(b)
    assert c.remove(CAROL, "x") is not None
    sync(a, b, c)
    assert a.value() == b.value() == c.value() == frozenset()


def test_or_set_re_add_after_remove_is_visible():
    s = ORSet(NS, "x")
    s.add(ALICE, "x")
    s.remove(BOB, "x")
    s.add(CAROL, "x")
    assert "x" in s and s.tags("x") == [(CAROL.peer_id_str, 1)]


def test_or_set_removing_your_own_add_leaves_no_tombstone():
    s = ORSet(NS, "x")
    s.add(ALICE, "x")
    entry = s.remove(ALICE, "x")
    assert entry.body == [{}, {}]
    assert s.value() == frozenset()


def test_or_set_owner_drops_its_adds_that_others_removed():
    a, b = replicas(ORSet)
    a.add(ALICE, "x")
    b.merge(a)
    b.remove(BOB, "x")
    a.merge(b)
    entry = a.add(ALICE, "y")  # ALICE's next write no longer carries the removed add
    assert list(entry.body[0].values()) == ["y"]
    assert a.value() == {"y"}


def test_or_set_remove_of_an_absent_element_writes_nothing():
    s = ORSet(NS, "x")
    assert s.remove(ALICE, "nobody") is None
    assert len(s) == 0


def test_or_set_elements_are_str_bytes_or_int_and_types_stay_distinct():
    s = ORSet(NS, "x")
    s.add(ALICE, "1")
    s.add(ALICE, b"1")
    s.add(ALICE, 1)
    assert s.value() == {"1", b"1", 1}
    for bad in (True, 1.0, None, ["list"]):
        with pytest.raises(CrdtError):
            s.add(ALICE, bad)
    assert True not in s


# --- signing, scope and verification --------------------------------------------------------------


@pytest.mark.parametrize(
    "other_scope",
    [
        EntryScope("swarm-2", "x", "gcounter"),
        EntryScope(NS, "y", "gcounter"),
        EntryScope(NS, "x", "pncounter"),
    ],
    ids=["other swarm", "other crdt", "other type"],
)
def test_an_entry_signed_for_another_scope_does_not_verify(other_scope):
    entry = sign_entry(ALICE, other_scope, 1, 5)
    counter = GCounter(NS, "x")
    outcome = counter.apply([entry])
    assert outcome.accepted == () and "signature" in outcome.rejected[0].reason
    assert verify_entry(other_scope, entry) and not verify_entry(counter.scope, entry)


def test_an_entry_whose_owner_is_not_an_ed25519_peer_id_is_rejected():
    entry = sign_entry(ALICE, EntryScope(NS, "x", "gcounter"), 1, 5)
    for owner in ("not-a-peer-id", "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"):
        forged = SignedEntry(owner, 1, 5, entry.signature)
        assert GCounter(NS, "x").apply([forged]).rejected


def test_merging_the_same_delta_twice_verifies_once():
    cache = SignatureCache()
    writer = GCounter(NS, "x", cache=SignatureCache())
    delta = writer.increment(ALICE, 2)
    reader = GCounter(NS, "x", cache=cache)
    assert reader.apply([delta]).accepted == (delta,)
    assert reader.apply([delta]).accepted == ()
    assert cache.verifications == 1


def test_verified_entries_are_not_verified_again_in_another_state():
    cache = SignatureCache()
    source = GCounter(NS, "x", cache=SignatureCache())
    for who in (ALICE, BOB, CAROL):
        source.increment(who)
    first, second = GCounter(NS, "x", cache=cache), GCounter(NS, "x", cache=cache)
    first.apply(source.entries())
    second.merge(first)
    assert cache.verifications == 3
    assert second == first


def test_the_cache_does_not_accept_a_new_body_under_a_verified_signature():
    cache = SignatureCache()
    genuine = GCounter(NS, "x", cache=cache)
    entry = genuine.increment(ALICE, 1)
    forged = SignedEntry(entry.owner, entry.seq + 1, 1000, entry.signature)
    assert genuine.apply([forged]).rejected
    assert genuine.value() == 1


def test_equivocating_entries_resolve_to_the_larger_signature_in_any_order():
    first_life, second_life = replicas(GCounter)
    one = first_life.increment(ALICE, 1)
    other = second_life.increment(ALICE, 50)  # lost its state: seq 1 again, different body
    expected = max(one, other, key=lambda e: e.signature)
    x, y = replicas(GCounter)
    x.apply([one, other])
    y.apply([other, one])
    assert x.entry(ALICE.peer_id_str) == y.entry(ALICE.peer_id_str) == expected


def test_anti_entropy_repairs_an_equivocation_between_replicas():
    a, b = replicas(GCounter)
    a.increment(ALICE, 1)
    b.increment(ALICE, 50)  # same owner and seq, different entries
    a_to_b = a.delta_since(digest_from_wire({o: list(v) for o, v in b.digest().items()}))
    b_to_a = b.delta_since(a.digest())
    assert len(a_to_b) + len(b_to_a) == 1  # exactly the winner travels
    b.apply(a_to_b)
    a.apply(b_to_a)
    assert a == b


def test_delta_since_a_version_vector_sends_only_newer_seqs():
    a = GCounter(NS, "x")
    a.increment(ALICE)
    a.increment(ALICE)
    a.increment(BOB)
    assert a.delta_since({ALICE.peer_id_str: 2}) == [a.entry(BOB.peer_id_str)]
    assert a.delta_since(a.version_vector()) == []


def test_entries_built_in_process_with_wrong_field_types_are_rejected_not_raised():
    good = GCounter(NS, "x").increment(ALICE)
    odd = [
        SignedEntry(["owner"], 1, 1, good.signature),
        SignedEntry(good.owner, "1", 1, good.signature),
        SignedEntry(good.owner, True, 1, good.signature),
        SignedEntry(good.owner, 1, 1, "sig"),
        SignedEntry(good.owner, 1, object(), good.signature),
    ]
    counter = GCounter(NS, "x")
    outcome = counter.apply(odd)
    assert len(outcome.rejected) == len(odd) and len(counter) == 0


def test_merging_crdts_of_different_scopes_or_types_is_refused():
    with pytest.raises(CrdtError):
        GCounter(NS, "x").merge(GCounter(NS, "y"))
    with pytest.raises(CrdtError):
        GCounter(NS, "x").merge(PNCounter(NS, "x"))
    with pytest.raises(CrdtError):
        GCounter(NS, "x").apply(["not an entry"])


def test_unencodable_values_are_refused_before_anything_is_written():
    m = LWWMap(NS, "x")
    for bad in (
        object(),
        {1.5: "float key"},
        2**64,
        [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[0]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]],
    ):
        with pytest.raises(CrdtError):
            m.set(ALICE, "k", bad)
    with pytest.raises(CrdtError):
        m.set(ALICE, 7, "non-str key")
    assert len(m) == 0


def test_scope_names_must_be_non_empty_strings():
    for namespace, name in (("", "x"), (NS, ""), (NS, 3), ("s" * 300, "x")):
        with pytest.raises(CrdtError):
            GCounter(namespace, name)


# --- encoding -------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", list(CRDT_TYPES.values()), ids=lambda c: c.__name__)
def test_empty_state_round_trips(cls):
    empty = cls(NS, "x")
    assert cls.from_bytes(empty.to_bytes(), NS, "x") == empty


def test_from_bytes_is_all_or_nothing():
    counter = GCounter(NS, "x")
    counter.increment(ALICE)
    counter.increment(BOB)
    raw = counter.to_bytes()
    with pytest.raises(RejectedEntries):
        GCounter.from_bytes(raw, "another-swarm", "x")
    with pytest.raises(MalformedCrdtData):
        PNCounter.from_bytes(raw, NS, "x")  # type tag mismatch
    dup = counter.encode_entries(counter.entries() + counter.entries())
    with pytest.raises(MalformedCrdtData, match="one entry per owner"):
        GCounter.from_bytes(dup, NS, "x")


def test_decoded_entries_are_canonical_whatever_map_order_the_sender_used():
    m = LWWMap(NS, "x")
    entry = m.set(ALICE, "b", 1, timestamp=1)
    entry = m.set(ALICE, "a", 2, timestamp=1)
    reordered_body = dict(reversed(list(entry.body.items())))
    raw = msgpack.packb([1, "lwwmap", [[entry.owner, entry.seq, reordered_body, entry.signature]]])
    fresh = LWWMap(NS, "x")
    assert fresh.apply(LWWMap.decode_entries(raw)).accepted
    assert fresh.to_bytes() == m.to_bytes()


def test_signature_length_is_checked_on_decode():
    with pytest.raises(MalformedCrdtData):
        SignedEntry.from_wire([ALICE.peer_id_str, 1, 0, b"\x00" * (SIGNATURE_BYTES - 1)])
