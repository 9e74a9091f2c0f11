"""Whose records a member stores (keep strangers honest): the replica's gate.

Identities are free, so a stranger could sign progress and metrics records — or membership
records that fail the swarm's admission rule — with as many as it likes, and every member would
store them and spread them by anti-entropy. With a `keep` rule, `SwarmView` gates its replica:
such records are refused, counted, and never forwarded; a real joiner whose progress arrives
before its membership record still ends with its progress stored everywhere: the refused entry
is parked and merged again once its owner's membership record is taken, and anti-entropy
(digest-based) offers it again at every exchange in any case.

Real py-libp2p hosts on loopback, plus the merge rule without a network (a property test, and
`Replica.install_gate` with its park reasons).
"""

from __future__ import annotations

import random
from contextlib import AsyncExitStack
from types import SimpleNamespace

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshtrain.crdt import CrdtError, Replica, ReplicaConfig, SwarmView, swarm_specs
from meshtrain.crdt.entries import SignedEntry, encode_entries
from meshtrain.crdt.record_gate import REFUSED_NOT_A_MEMBER, REFUSED_NOT_ADMITTED
from meshtrain.crdt.swarm_view import MEMBERSHIP, METRICS, PROGRESS
from meshtrain.crdt.types import LWWRegister, now_ms
from meshtrain.transport.framing import packb
from meshtrain.transport.identity import Identity

from .test_crdt_replica import connect_line, start_hosts, start_replicas, wait_until

SWARM = "test-swarm"  # the namespace of test_crdt_replica's helpers
FAST = ReplicaConfig(anti_entropy_interval=0.3, rpc_timeout=3.0)
VIEW = {"heartbeat_interval": 0.3, "ttl": 1.5, "recover_timeout": 2.0, "swarm_heartbeat_rate": 100.0}
MEMBER_CAPS = {"ticket": 1}  # the admission rule of these tests: a record showing a ticket


def has_ticket(peer_id: str, capabilities: dict) -> bool:
    return capabilities.get("ticket") == 1


def membership_record(ts: int, caps: dict) -> list:
    return [ts, {"addrs": [], "role": "trainer", "caps": caps, "conn": "direct", "lease": 60_000, "left": False}]


def signed(identity: Identity, crdt: str, record: list) -> SignedEntry:
    """`identity`'s entry for CRDT `crdt` of this swarm (what a hostile peer can sign for free)."""
    return LWWRegister(SWARM, crdt).set(identity, record[1], timestamp=record[0])


def owners(view: SwarmView, crdt: str) -> set[str]:
    return owners_of(view.replica, crdt)


def owners_of(replica: Replica, crdt: str) -> set[str]:
    return {e.owner for e in replica.crdt(crdt).entries()}


async def test_a_non_members_records_are_neither_stored_nor_forwarded():
    """m0 - m1 - s: the stranger s reaches m1 only. Its own records (membership without a
    ticket, progress, metrics) and those of identities it minted (no membership record at all),
    by gossip and by anti-entropy push, are refused by m1, counted, and never reach m0."""
    async with AsyncExitStack() as stack:
        hosts = await start_hosts(stack, 3)
        m0, m1, s = hosts
        replicas = await start_replicas(stack, hosts, specs=swarm_specs(m0.peer_id), config=FAST)
        await connect_line(hosts)
        views = [
            await stack.enter_async_context(
                SwarmView(
                    r,
                    m0.peer_id,
                    capabilities=MEMBER_CAPS,
                    keep=has_ticket,
                    admit=lambda p: has_ticket(p.peer_id, p.capabilities),
                    **VIEW,
                )
            )
            for r in replicas[:2]
        ]
        stranger = await stack.enter_async_context(SwarmView(replicas[2], m0.peer_id, **VIEW))  # no ticket
        stranger.report_progress(step=1 << 40, outer_round=1 << 40)  # written at once: a round change
        stranger.report_metrics({"loss": -1.0})
        minted = [Identity.generate() for _ in range(5)]
        ts = now_ms()
        batch = {
            PROGRESS: [signed(i, PROGRESS, [ts, {"step": 1, "samples": 1, "round": 1}]) for i in minted],
            METRICS: [signed(i, METRICS, [ts, {"loss": 1.0}]) for i in minted],
        }
        reply = await s.rpc.call(
            m1.peer_id,
            "crdt/pull",
            {"ns": SWARM, "d": {}, "p": {n: encode_entries("lwwregister", es) for n, es in batch.items()}},
        )
        assert reply["rejected"] == 10
        await replicas[2].pubsub.publish(
            replicas[2].topic,
            packb([1, SWARM, [[n, encode_entries("lwwregister", es)] for n, es in batch.items()]]),
        )
        for v in views:
            v.report_progress(step=3)
        members = {m0.peer_id, m1.peer_id}
        await wait_until(lambda: all(owners(v, PROGRESS) == members for v in views), 5, "members' progress")
        await trio.sleep(1.5)  # sleep: several anti-entropy exchanges and heartbeats pass before the checks below

        refusals = views[1].replica.stats.refusals_by_reason
        assert refusals.get(REFUSED_NOT_A_MEMBER, 0) >= 12 and refusals.get(REFUSED_NOT_ADMITTED, 0) >= 1
        for v in views:
            for crdt in (MEMBERSHIP, PROGRESS, METRICS):
                assert owners(v, crdt) <= members, (crdt, v.me)
            assert owners(v, MEMBERSHIP) == owners(v, PROGRESS) == members
        assert views[0].replica.stats.entries_refused == 0  # m1 forwarded nothing of the stranger's
        await wait_until(  # the members still converge (heartbeats keep changing the state)
            lambda: views[0].replica.fingerprint() == views[1].replica.fingerprint(), 3, "members in sync"
        )
        assert [p.peer_id for p in views[1].ignored_peers()] == [s.peer_id]  # named, not stored
        assert s.peer_id in owners(stranger, PROGRESS)  # its own replica keeps its own records
        # One peer's record, as a coordinator asks it, is the whole map's entry (admitted or absent)
        for v in (*views, stranger):
            for peer in (*members, s.peer_id, *(i.peer_id_str for i in minted)):
                assert v.progress_of(peer) == v.progress().get(peer), (v.me, peer)
        assert views[0].progress_of(m1.peer_id) is not None and views[0].progress_of(s.peer_id) is None


async def test_a_joiners_progress_that_arrives_before_its_membership_is_stored_once_it_is_a_member():
    """The order a "no donor" race once hinged on, driven on purpose: the joiner's progress
    record reaches a member (anti-entropy push) before its membership record exists anywhere.
    It is refused then; once the joiner's view writes its membership record, anti-entropy offers
    the progress again (the joiner never rewrites it) and every member stores it."""
    async with AsyncExitStack() as stack:
        hosts = await start_hosts(stack, 3)
        m0, m1, j = hosts
        replicas = await start_replicas(stack, hosts, specs=swarm_specs(m0.peer_id), config=FAST)
        await m1.connect(m0.addrs[0])
        views = [
            await stack.enter_async_context(SwarmView(r, m0.peer_id, capabilities=MEMBER_CAPS, keep=has_ticket, **VIEW))
            for r in replicas[:2]
        ]
        joiner = replicas[2]
        record = {"step": 42, "samples": 4200, "round": 4}
        entry = joiner.write(PROGRESS, lambda c, me: c.set(me, record, timestamp=now_ms()))
        await j.connect(m1.addrs[0])
        reply = await j.rpc.call(
            m1.peer_id, "crdt/pull", {"ns": SWARM, "d": {}, "p": {PROGRESS: encode_entries("lwwregister", [entry])}}
        )
        assert reply["rejected"] == 1  # progress first: refused, not stored
        assert views[1].replica.stats.refusals_by_reason[REFUSED_NOT_A_MEMBER] >= 1
        assert j.peer_id not in owners(views[1], PROGRESS)

        view = await stack.enter_async_context(
            SwarmView(joiner, m0.peer_id, capabilities=MEMBER_CAPS, keep=has_ticket, **VIEW)
        )
        await wait_until(
            lambda: all(v.progress().get(j.peer_id) is not None for v in views), 5, "the joiner's progress everywhere"
        )
        for v in views:  # the refused entry itself (the joiner's view never rewrote it)
            assert v.replica.crdt(PROGRESS).entry(j.peer_id) == entry and v.progress()[j.peer_id].step == 42
        assert view.replica.crdt(PROGRESS).entry(j.peer_id) == entry


# --- the merge rule, without a network ------------------------------------------------------------

IDENTITIES = [Identity.generate() for _ in range(4)]  # 0, 1: with a ticket; 2: without; 3: no record
LOCAL = Identity.generate()


def gated_replica() -> Replica:
    """A replica with a gated view, on a stand-in host: merging touches neither host nor network."""
    host = SimpleNamespace(identity=LOCAL, peer_id=LOCAL.peer_id_str)
    replica = Replica(host, SWARM, swarm_specs(LOCAL.peer_id_str))  # type: ignore[arg-type]
    SwarmView(replica, LOCAL.peer_id_str, keep=has_ticket, **VIEW)
    return replica


def history() -> list[tuple[str, SignedEntry]]:
    """Every identity's records: two progress records each, a membership record for 0-2."""
    out = []
    for n, ident in enumerate(IDENTITIES):
        if n < 3:
            caps = MEMBER_CAPS if n < 2 else {}
            out.append((MEMBERSHIP, signed(ident, MEMBERSHIP, membership_record(1000 + n, caps))))
        reg = LWWRegister(SWARM, PROGRESS)
        for step in (1, 2):
            out.append((PROGRESS, reg.set(ident, {"step": step, "samples": step, "round": 0}, timestamp=step)))
    return out


HISTORY = history()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.permutations(range(len(HISTORY))), st.integers(1, 4), st.randoms(use_true_random=False))
def test_refused_entries_are_taken_when_offered_again_in_any_delivery_order(order, batch, rnd: random.Random):
    """Whatever order and batches the entries arrive in (progress before membership included), no
    record of a non-member is ever stored, and one more anti-entropy pass — everything offered
    again — leaves exactly the members' latest records: the state that delivering all at once
    builds. So replicas that saw different orders converge."""
    reference = gated_replica()
    for name in (MEMBERSHIP, PROGRESS):  # all at once, membership first
        reference.merge_entries(name, [e for n, e in HISTORY if n == name], "anti-entropy", None)
    members = {IDENTITIES[0].peer_id_str, IDENTITIES[1].peer_id_str}

    replica = gated_replica()
    delivered = [HISTORY[i] for i in order]
    for start in range(0, len(delivered), batch):
        by_crdt: dict[str, list[SignedEntry]] = {}
        for name, entry in delivered[start : start + batch]:
            by_crdt.setdefault(name, []).append(entry)
        batches = list(by_crdt.items())
        rnd.shuffle(batches)  # progress before membership within one message too
        for name, entries in batches:
            replica.merge_entries(name, entries, "gossip", None)
        for name in (MEMBERSHIP, PROGRESS):
            assert {e.owner for e in replica.crdt(name).entries()} <= members
    # A member's record refused before its membership arrived was parked and taken with it: the
    # replica holds the all-at-once state before anything is offered again.
    assert replica.fingerprint() == reference.fingerprint()
    for name in (MEMBERSHIP, PROGRESS):  # the next anti-entropy exchange: everything offered again
        replica.merge_entries(name, [e for n, e in HISTORY if n == name], "anti-entropy", None)

    assert replica.fingerprint() == reference.fingerprint()
    assert {e.owner for e in replica.crdt(PROGRESS).entries()} == members
    assert all(e.body[1]["step"] == 2 for e in replica.crdt(PROGRESS).entries())


def test_a_parked_entry_refused_again_is_counted_once():
    """A record refused for want of its owner's membership is parked and merged again after every
    accepted entry; while its owner is still no member it is refused again, but counted once."""
    replica = gated_replica()
    stranger = IDENTITIES[3].peer_id_str  # no membership record at all
    early = [e for n, e in HISTORY if n == PROGRESS and e.owner == stranger][-1]
    replica.merge_entries(PROGRESS, [early], "gossip", None)
    for entry in [e for n, e in HISTORY if n == MEMBERSHIP][:2]:  # members': each retries the parked one
        assert replica.merge_entries(MEMBERSHIP, [entry], "gossip", None).accepted
    assert stranger not in {e.owner for e in replica.crdt(PROGRESS).entries()}
    assert replica.stats.entries_refused == 1
    assert replica.stats.refusals_by_reason == {REFUSED_NOT_A_MEMBER: 1}


def test_a_refusal_for_a_park_reason_is_taken_once_another_entry_lets_it_through():
    """`Replica.install_gate(gate, park_reasons=...)`: a refusal for a park reason is merged again
    after the next accepted entry; one for another reason waits for anti-entropy to offer it."""
    host = SimpleNamespace(identity=LOCAL, peer_id=LOCAL.peer_id_str)
    replica = Replica(host, SWARM, swarm_specs(LOCAL.peer_id_str))  # type: ignore[arg-type]
    waiting, admitted = IDENTITIES[0], set()
    stranger = IDENTITIES[1]

    def gate(name: str, entry: SignedEntry) -> str | None:
        if name == MEMBERSHIP or entry.owner in admitted:
            return None
        return "not-yet" if entry.owner == waiting.peer_id_str else "never"

    replica.install_gate(gate, park_reasons={"not-yet"})
    progress = {
        who: LWWRegister(SWARM, PROGRESS).set(who, {"step": 3, "samples": 3, "round": 0}, timestamp=3)
        for who in (waiting, stranger)
    }
    for entry in progress.values():
        assert replica.merge_entries(PROGRESS, [entry], "gossip", None).rejected
    assert replica.stats.refusals_by_reason == {"not-yet": 1, "never": 1}
    admitted.update({waiting.peer_id_str, stranger.peer_id_str})
    replica.merge_entries(MEMBERSHIP, [signed(waiting, MEMBERSHIP, membership_record(1000, {}))], "gossip", None)
    assert owners_of(replica, PROGRESS) == {waiting.peer_id_str}  # the parked one; the other is not retried
    with pytest.raises(CrdtError, match="already has a gate"):
        replica.install_gate(gate)
