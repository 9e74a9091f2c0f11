"""Anti-entropy by owner bucket (crdt/fingerprints.py): two replicas of a large CRDT that differ in
a few owners exchange the digest of the differing buckets only, and still end identical."""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshtrain.crdt import GCounter, MalformedCrdtData
from meshtrain.crdt.fingerprints import (
    MAX_BUCKETS,
    MIN_BUCKETED,
    bucket_count,
    bucket_fingerprints,
    bucket_of,
    parse_bucket_fingerprints,
    parse_bucket_scope,
    restrict,
)
from meshtrain.transport.identity import Identity
from meshtrain.transport.rpc import RemoteError

from .test_crdt_replica import GOSSIP_ONLY, SWARM, start_hosts, start_replicas

owners = st.lists(st.text("abcdef0123456789", min_size=4, max_size=12), min_size=0, max_size=80, unique=True)


@settings(max_examples=150, deadline=None)
@given(owners, st.data())
def test_differing_buckets_hold_every_owner_where_two_digests_differ(names, data):
    """Whatever two digests are, the buckets whose fingerprints differ cover every owner on which
    they differ, the buckets partition each digest, and the count follows the digest's size."""
    a = {o: (data.draw(st.integers(1, 3)), b"x") for o in names}
    b = {o: v for o, v in a.items() if data.draw(st.booleans()) or len(a) < 2}
    for o in data.draw(st.lists(st.sampled_from(names), max_size=5)) if names else []:
        b[o] = (a[o][0] + 1, b"y")
    count = data.draw(st.sampled_from([2, 4, 16, 64, MAX_BUCKETS]))
    fa, fb = bucket_fingerprints(a, count), bucket_fingerprints(b, count)
    differ = {i for i in range(count) if fa[i] != fb[i]}
    for o in set(a) | set(b):
        if a.get(o) != b.get(o):
            assert bucket_of(o, count) in differ
    assert restrict(a, range(count), count) == a
    assert {o for i in range(count) for o in restrict(a, [i], count)} == set(a)
    assert sum(len(restrict(a, [i], count)) for i in range(count)) == len(a)
    n = len(a)
    c = bucket_count(n)
    assert (c == 0) == (n < MIN_BUCKETED)
    if c:
        assert c & (c - 1) == 0 and 2 <= c <= MAX_BUCKETS and n / c <= 8


def test_hostile_bucket_fields_are_refused():
    names = {"samples": None}
    fp = b"\0" * 16
    for bad in (
        [],
        {"samples": [fp] * 3},
        {"samples": [fp] * (2 * MAX_BUCKETS)},
        {"samples": [fp, b"short"]},
        {"samples": "no"},
        {f"x{i}": [fp, fp] for i in range(40)},
    ):
        with pytest.raises(MalformedCrdtData):
            parse_bucket_fingerprints(bad, names)
    assert parse_bucket_fingerprints({"other": [fp, fp], "samples": [fp] * 4}, names) == {"samples": [fp] * 4}
    for bad in (
        {"samples": [3, [0]]},
        {"samples": [4, [4]]},
        {"samples": [4, [1, 1]]},
        {"samples": [4, [True]]},
        {"samples": [2, [0, 1, 0]]},
        {"samples": [4]},
        {"samples": [True, []]},
        "no",
    ):
        with pytest.raises(MalformedCrdtData):
            parse_bucket_scope(bad, names)
    scope = parse_bucket_scope({"samples": [8, [5, 1]], "other": [2, [0]]}, names)["samples"]
    assert scope.count == 8 and scope.buckets == {1, 5}


async def test_two_replicas_of_a_large_crdt_exchange_only_the_differing_buckets_and_end_identical():
    """Real hosts on loopback: 200 writers' counters on both replicas, 3 differing (two newer on
    one side, one only on the other). The digest reply names the few differing buckets and holds
    only their owners; one anti-entropy exchange then makes both replicas identical. Hostile
    bucket fields in either RPC are refused as malformed."""
    writers = [Identity.generate() for _ in range(200)]
    counter = GCounter(SWARM, "samples")
    common = [counter.increment(w, 1) for w in writers]
    newer = [counter.increment(w, 5) for w in writers[:2]]
    async with AsyncExitStack() as stack:
        hosts = await start_hosts(stack, 3)
        left, right = await start_replicas(stack, hosts[:2], config=GOSSIP_ONLY)
        left.merge_entries("samples", common[:-1] + newer, "gossip", None)
        right.merge_entries("samples", common, "gossip", None)
        count = bucket_count(len(right.crdt("samples")))
        assert count >= 16
        # Asked by a host that runs no replica: the two replicas are not connected yet.
        asker = hosts[2]
        await asker.connect(hosts[0].addrs[0])
        request = {"ns": SWARM, "fp": {}, "fb": {"samples": right.bucket_fingerprints("samples", count)}}
        reply = await asker.rpc.call(left.host.peer_id, "crdt/digest", request)
        sent_count, buckets = reply["b"]["samples"]
        differing = {bucket_of(w.peer_id_str, count) for w in writers[:2]} | {bucket_of(writers[-1].peer_id_str, count)}
        assert sent_count == count and set(buckets) == differing
        sent = set(reply["d"]["samples"])  # a few buckets' owners, not 200
        assert sent == set(restrict(left.crdt("samples").digest(), buckets, count)) and len(sent) < 100
        assert set(reply["b"]) == {"samples"}  # CRDTs under MIN_BUCKETED entries go whole

        await hosts[1].connect(hosts[0].addrs[0])
        assert await right.anti_entropy.exchange_with(left.host.peer_id)
        assert left.fingerprint() == right.fingerprint()
        assert right.crdt("samples").value() == left.crdt("samples").value() == counter.value()

        for bad in ({"samples": [b"\0" * 16] * 3}, {"samples": 7}):
            with pytest.raises(RemoteError, match="malformed"):
                await asker.rpc.call(left.host.peer_id, "crdt/digest", {"ns": SWARM, "fp": {}, "fb": bad})
        with pytest.raises(RemoteError, match="malformed"):
            await hosts[1].rpc.call(
                left.host.peer_id, "crdt/pull", {"ns": SWARM, "d": {}, "p": {}, "b": {"samples": [4, [9]]}}
            )
