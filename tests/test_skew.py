"""Liveness that does not trust wall clocks (crdt/swarm_records.py `Freshness`, crdt/swarm_view.py),
and the clock offset exchange (node/clock_offsets.py).

The rule as properties: a record is never dated later than it arrived; a record we hold,
relayed again, is no news (a heartbeat relayed late vouches for one lease at most, never for
ever); once an owner handed us a record, its clock's offset changes nothing. Then the view: a
peer whose clock is a minute behind, a minute ahead or ten minutes ahead is live while its
heartbeats arrive and gone a lease after they stop. Last, real daemons whose wall clocks
libfaketime shifts (scripts/bench/bench_skew.py) train every round together and measure each
other's offsets.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from meshtrain.crdt import Replica, SwarmView, swarm_specs
from meshtrain.crdt.entries import SignedEntry
from meshtrain.crdt.swarm_records import MEMBERSHIP, PAUSE_S, PULSE_S, Freshness, LoopPauses
from meshtrain.crdt.swarm_view import open_swarm_view
from meshtrain.crdt.types import LWWRegister, now_ms
from meshtrain.node.clock_offsets import ClockOffsets, offset_from_exchange
from meshtrain.node.status.server import StatusServer
from meshtrain.transport.host import Host
from meshtrain.transport.identity import Identity
from scripts.bench.bench_skew import faketime_library, skewed_swarm

from .conftest import start_peers

SWARM = "skew-test"
OWNER = Identity.generate()


def entry(seq: int, stamp_ms: int) -> SignedEntry:
    """An owner's membership-like entry with `seq` and timestamp `stamp_ms` (signature unused)."""
    return SignedEntry(OWNER.peer_id_str, seq, [stamp_ms, {}], b"")


# A delivery: (seconds after the previous one, seq, handed over by the owner). The owner writes
# seq n at true time n seconds; its clock reads that plus its offset.
deliveries = st.lists(st.tuples(st.floats(0, 20), st.integers(1, 12), st.booleans()), min_size=1, max_size=30)


def replay(plan, offset_s: float) -> list[float | None]:
    """Ages of the owner's record after each delivery of `plan` (our wall clock = our monotonic)."""
    fresh, now, ages = Freshness(), 1000.0, []
    for gap, seq, from_owner in plan:
        now += gap
        stamp = round((1000.0 + seq + offset_s) * 1000)
        fresh.heard(entry(seq, stamp), now=now, wall_now_ms=round(now * 1000), from_owner=from_owner)
        ages.append(fresh.age(OWNER.peer_id_str, now))
    return ages


@settings(max_examples=300, deadline=None)
@given(deliveries, st.floats(-900, 900))
def test_a_record_is_never_dated_after_it_arrived_and_only_a_newer_one_refreshes(plan, offset_s):
    fresh, now, held, dated_at = Freshness(), 1000.0, 0, None
    for gap, seq, from_owner in plan:
        now += gap
        before = fresh.age(OWNER.peer_id_str, now)
        fresh.heard(
            entry(seq, round((now + offset_s) * 1000)), now=now, wall_now_ms=round(now * 1000), from_owner=from_owner
        )
        age = fresh.age(OWNER.peer_id_str, now)
        assert age is not None and age >= 0  # never dated in the future
        if seq <= held:
            assert age == before  # relayed again (or older): no news, the lease is not renewed
        else:
            held, dated_at = seq, now - age
    # Whatever arrives later, a record vouches for its owner from when it was dated, not longer.
    assert dated_at is not None and fresh.age(OWNER.peer_id_str, now + 12.0) == pytest.approx(now + 12.0 - dated_at)


@settings(max_examples=300, deadline=None)
@given(deliveries, st.floats(-900, 900))
def test_once_the_owner_handed_us_a_record_its_clock_offset_changes_nothing(plan, offset_s):
    plan = [(plan[0][0], plan[0][1], True), *plan[1:]]  # the first record came from its owner
    assert replay(plan, offset_s) == pytest.approx(replay(plan, 0.0))


def test_a_first_record_relayed_is_dated_by_its_timestamp_and_never_in_the_future():
    fresh = Freshness()
    fresh.heard(entry(5, 990_000), now=50.0, wall_now_ms=1_000_000, from_owner=False)
    assert fresh.age(OWNER.peer_id_str, 50.0) == 10.0  # written 10 s ago by our wall clock
    ahead = Freshness()
    ahead.heard(entry(5, 1_600_000), now=50.0, wall_now_ms=1_000_000, from_owner=False)
    assert ahead.age(OWNER.peer_id_str, 50.0) == 0.0  # 10 min ahead: as if written now
    # relayed newer records: dated from the previous one on the owner's clock, never after arrival
    fresh.heard(entry(6, 993_000), now=51.0, wall_now_ms=1_001_000, from_owner=False)
    assert fresh.age(OWNER.peer_id_str, 51.0) == pytest.approx(8.0)
    fresh.heard(entry(7, 2_000_000), now=52.0, wall_now_ms=1_002_000, from_owner=False)
    assert fresh.age(OWNER.peer_id_str, 52.0) == 0.0


def test_a_pause_of_our_own_is_left_out_of_every_age():
    """A soak's peer, SIGSTOPped 13 s inside a round it coordinated, resumed to find every other
    trainer's lease run out and committed the round alone. Records reach us only while we run:
    our own pause says nothing of anyone, and a peer that died meanwhile still runs out its lease
    from where it stood when we stopped."""
    pauses, now = LoopPauses(), 100.0
    for _ in range(10):  # the loop notes every PULSE_S: no pause
        now += PULSE_S
        assert pauses.note(now) == 0.0
    assert pauses.note(now + PAUSE_S) == 0.0  # a slow loop, not a pause
    now += PAUSE_S
    assert pauses.note(now - 1.0) == 0.0  # a clock read out of order moves nothing back
    fresh = Freshness()
    fresh.heard(entry(3, 1), now=now, wall_now_ms=1, from_owner=True)
    now += 2.0
    assert pauses.note(now) == 0.0
    stopped = 13.0
    now += stopped  # SIGSTOP: no note, no record
    pause = pauses.note(now)
    assert pause == pytest.approx(stopped - PULSE_S) and pauses.paused_s == pytest.approx(pause)
    assert fresh.age(OWNER.peer_id_str, now) == pytest.approx(2.0 + stopped)  # judged across it: gone (lease 12 s)
    fresh.pause(pause)
    assert fresh.age(OWNER.peer_id_str, now) == pytest.approx(2.0 + PULSE_S)  # as we left it
    assert fresh.age(OWNER.peer_id_str, now + 12.0) == pytest.approx(14.0 + PULSE_S)  # and it still ages


WRITERS: dict[str, LWWRegister] = {}  # each identity's own register: its seqs grow


def record(identity: Identity, stamp_ms: int, lease_ms: int = 12_000) -> SignedEntry:
    """`identity`'s next heartbeat, timestamped `stamp_ms` by its clock."""
    value = {"addrs": [], "role": "trainer", "caps": {}, "conn": "direct", "lease": lease_ms, "left": False}
    register = WRITERS.setdefault(identity.peer_id_str, LWWRegister(SWARM, MEMBERSHIP))
    return register.set(identity, value, timestamp=stamp_ms)


async def test_a_view_whose_loop_was_paused_past_a_lease_still_holds_its_peers_live():
    """Two running views on loopback, leases of 2 s. The views' own pause (their loop blocked
    past a lease, as a SIGSTOP or a suspended VM stops a process) is no evidence about a peer:
    asked right after it — before any record buffered meanwhile could be read — the other is
    still live, and it still runs out its lease after."""
    async with AsyncExitStack() as stack:
        a, b = await start_peers(stack, 2, streams=False)
        views = [
            await stack.enter_async_context(
                open_swarm_view(p.host, SWARM, a.host.peer_id, heartbeat_interval=0.5, ttl=2.0)
            )
            for p in (a, b)
        ]
        with trio.fail_after(20):
            while not views[0].is_live(b.id):
                await trio.sleep(0.1)  # sleep: poll interval
        time.sleep(PAUSE_S + 0.5)  # sleep: the loop's own pause is what is tested (blocked, no await)
        assert views[0].is_live(b.id)  # judged across the pause, its age was 3.5 s of a 2 s lease
        assert not views[0].is_live(b.id, at=time.monotonic() + 2.0)  # it still ages


async def test_peers_a_minute_behind_a_minute_ahead_and_ten_minutes_ahead_are_live_while_they_beat():
    host = Host(Identity.generate())  # never started: records are merged by hand
    replica = Replica(host, SWARM, swarm_specs(host.peer_id))
    view = SwarmView(replica, host.peer_id, addrs=[])
    view.heartbeat()
    skewed = {Identity.generate(): shift for shift in (-60_000, 60_000, 600_000)}
    for identity, shift in skewed.items():  # each one's heartbeat, gossiped by itself
        me = identity.peer_id_str
        replica.merge_entries(MEMBERSHIP, [record(identity, now_ms() + shift)], "gossip", me)
    at = time.monotonic()
    assert len(view.membership_snapshot(at=at)) == 4  # the old rule dropped the one behind
    assert len(view.membership_snapshot(at=at + 11.9)) == 4
    gone = view.membership_snapshot(at=at + 12.1)  # a lease later: the old rule kept those ahead
    assert not {i.peer_id_str for i in skewed} & set(gone)

    # Met first through someone else (a joiner's recovery), the one behind waits for its next
    # heartbeat, which comes from itself.
    late = Replica(Host(Identity.generate()), SWARM, swarm_specs(host.peer_id))
    joiner = SwarmView(late, host.peer_id, addrs=[])
    behind = next(i for i, s in skewed.items() if s < 0)
    late.merge_entries(MEMBERSHIP, replica.crdt(MEMBERSHIP).entries(), "anti-entropy", host.peer_id)
    assert not joiner.is_live(behind.peer_id_str)
    late.merge_entries(MEMBERSHIP, [record(behind, now_ms() - 60_000 + 3_000)], "gossip", behind.peer_id_str)
    assert joiner.is_live(behind.peer_id_str)


async def test_node_status_and_metrics_show_each_peers_clock_offset(tmp_path):
    peer = {
        "peer_id": "12D3KooWskewed",
        "addr": "/ip4/127.0.0.1/tcp/4001",
        "connection": "direct",
        "role": "trainer",
        "step": 5,
        "loss": None,
        "last_seen_s": 1.0,
        "clock_offset_s": 60.004,
        "reachability": "public",
        "strikes": 0,
    }
    doc = {
        "node": {"peer_id": "12D3KooWme", "swarm": "ms01", "state": "training", "started": 0.0, "uptime_s": 1e12},
        "training": {
            "step": 5,
            "round": 1,
            "loss": None,
            "eval_loss": None,
            "optimizer": "diloco",
            "samples_per_s": 0.0,
            "bytes_sent": 0,
            "bytes_received": 0,
        },
        "peers": [peer],
    }
    async with StatusServer(lambda: doc, port=0, token="t0k3n", on_stop=lambda: None) as srv:
        (tmp_path / "daemon.json").write_text(json.dumps({"pid": os.getpid(), "status_url": srv.url}))
        human = await trio.to_thread.run_sync(
            lambda: subprocess.run(
                [sys.executable, "-m", "meshtrain.node.cli", "node", "status", "--data-dir", str(tmp_path)],
                capture_output=True,
                text=True,
                timeout=60,
            )
        )
        metrics = await trio.to_thread.run_sync(lambda: urllib.request.urlopen(f"{srv.url}/metrics").read().decode())
    assert "clock +60.0 s" in human.stdout, human.stderr
    assert 'meshtrain_peer_clock_offset_seconds{peer="12D3KooWskewed"} 60.004' in metrics


def test_ntp_offset_and_round_trip_from_four_timestamps():
    # the peer is 60 s ahead; 40 ms out, 10 ms inside the peer, 50 ms back
    got = offset_from_exchange(100.0, 160.040, 160.050, 100.100)
    assert got.offset_s == pytest.approx(59.995) and got.rtt_s == pytest.approx(0.090)
    # symmetric paths: exact
    assert offset_from_exchange(0.0, -9.95, -9.95, 0.1).offset_s == pytest.approx(-10.0)


async def test_two_hosts_measure_each_others_clock_within_half_a_round_trip():
    async with AsyncExitStack() as stack:
        a, b = await start_peers(stack, 2, streams=False)
        offsets = await stack.enter_async_context(ClockOffsets(a.host, lambda: [], interval=3600))
        await stack.enter_async_context(ClockOffsets(b.host, lambda: []))
        sample = await offsets.sample(b.host.peer_id)
        assert sample is not None and abs(sample.offset_s) <= sample.rtt_s / 2 + 0.01  # one clock
        assert offsets.offset(b.host.peer_id) == sample.offset_s


@pytest.mark.slow
@pytest.mark.skipif(
    faketime_library() is None, reason="needs libfaketime (apt-get install faketime; .ci/run installs it as root)"
)
def test_daemons_a_minute_behind_and_ten_minutes_ahead_train_every_round_and_measure_each_other(tmp_path):
    # three daemons at 0, -60 s and +10 min: each sees a peer a minute behind or ahead, and one
    # ten minutes ahead or behind
    got = skewed_swarm(tmp_path, [0, -60, 600], rounds=2)
    assert got["excluded"] == 0 and got["rounds_missed"] == 0, got
    assert got["max_offset_error_s"] <= 1.0, got
    # the unshifted daemon warned once about each of the two, naming it
    warnings = [ln for ln in Path(got["logs"][0]).read_text().splitlines() if "peer clock is off ours" in ln]
    assert len(warnings) == 2 and {w.split("peer=")[1].split()[0] for w in warnings} == set(got["peers"][1:])
