"""Late-joiner state sync between real hosts on loopback: several donors, verified chunks, liars."""

from __future__ import annotations

import os
import signal
import time
from contextlib import AsyncExitStack

import blake3
import pytest
import torch
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from meshtrain.collective.protocol import WHERE_RPC, WhereReply
from meshtrain.errors import MeshtrainError
from meshtrain.node.state.donor import StateDonor
from meshtrain.node.state.fetch import MANIFEST_TIMEOUT, FetchReport, fetch_state
from meshtrain.node.state.sync import (
    CHUNK_RPC,
    MANIFEST_RPC,
    DonorsExhausted,
    FlatState,
    NoAgreement,
    NoDonors,
    OfferDeclined,
    StateSyncError,
    chunk_ranges,
)
from meshtrain.optim.inner_moments import InnerMoments
from meshtrain.transport.data_channel import payload_digest
from meshtrain.transport.rpc import RemoteError
from meshtrain.transport.tensor_layout import byte_views
from meshtrain.transport.tensor_streams import TransferError

from .conftest import read_json, spawn, start_peers
from .freezing_relay import FreezingRelay
from .proc_donor import make_state

KIB = 1024
MIB = 1 << 20


def assert_same_state(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert sorted(expected) == list(got)  # returned in the canonical (name) order
    for k, v in expected.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
    assert payload_digest({k: got[k] for k in sorted(got)}) == payload_digest(
        {k: expected[k] for k in sorted(expected)}
    )


async def start_swarm(stack: AsyncExitStack, n_donors: int, *, donor_cls=StateDonor, **donor_kw):
    """A joiner and `n_donors` donors (real hosts, each with its data plane), all connected."""
    peers = await start_peers(stack, n_donors + 1)
    joiner, rest = peers[0], peers[1:]
    donors = [
        (donor_cls[i] if isinstance(donor_cls, list) else donor_cls)(p.host, p.ts, **donor_kw)
        for i, p in enumerate(rest)
    ]
    return joiner, donors


def ids(donors: list[StateDonor]) -> list[str]:
    return [d.host.peer_id for d in donors]


class CorruptingDonor(StateDonor):
    """Publishes the honest manifest but flips a byte in every chunk it serves. With
    `announce_true_digest` it announces the honest chunk digest (the data plane catches the
    mismatch); without, it lets the data plane announce the digest of what it really sent
    (only the joiner's check against the agreed manifest catches it)."""

    announce_true_digest = False

    async def _send_chunk(self, peer, tag, snap, start, end, chunk_digest):
        pieces = {k: v.clone() for k, v in snap.flat.slices(start, end).items()}
        next(iter(pieces.values()))[0] ^= 0xFF
        await self.streams.send(
            peer, tag, pieces, digest=chunk_digest if self.announce_true_digest else None, timeout=10
        )


class AnnouncingCorruptingDonor(CorruptingDonor):
    announce_true_digest = True


# -- the happy path ----------------------------------------------------------------------------


async def test_joiner_gets_bit_identical_state_and_uses_every_donor():
    async with AsyncExitStack() as stack:
        joiner, donors = await start_swarm(stack, 3, upload_limit=16 * MIB)
        meta, tensors = make_state(6 << 10)
        for d in donors:
            d.publish(meta, tensors)
        report = FetchReport()
        seen = []
        got_meta, got = await fetch_state(
            joiner.host,
            joiner.ts,
            ids(donors),
            chunk_bytes=256 * KIB,
            progress=lambda done, total: seen.append((done, total)),
            report=report,
            timeout=60,
        )
        assert got_meta == meta
        assert_same_state(tensors, got)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        assert report.total_bytes == total and report.chunks == len(chunk_ranges(total, 256 * KIB))
        # Every donor served a fair share (each is throttled to 16 MiB/s, so one alone is slow),
        # and what the joiner counted matches what the donors say they sent.
        assert set(report.bytes_per_donor) == set(ids(donors))
        assert sum(report.bytes_per_donor.values()) == total
        for d in donors:
            assert report.chunks_per_donor[d.host.peer_id] >= report.chunks // 6, report.chunks_per_donor
            assert d.bytes_served_to[joiner.id] >= report.bytes_per_donor[d.host.peer_id]
            assert d.states_taken[joiner.id] == meta["step"]  # the joiner carries this donor's state
        assert not report.banned
        assert [t for _, t in seen] == [total] * len(seen)
        assert [d for d, _ in seen] == sorted(d for d, _ in seen) and seen[-1][0] == total


async def test_the_donors_inner_moments_come_beside_the_vote_as_their_median():
    """Each donor describes its own inner optimizer (optim/inner_moments.py) beside its manifest:
    the descriptions differ, yet the donors still agree on the state, and the joiner's report
    holds their median, a lying donor's description kept inside the honest range."""
    async with AsyncExitStack() as stack:
        joiner, donors = await start_swarm(stack, 4)
        meta, tensors = make_state(256 << 10)
        described = [
            InnerMoments(100, {"w": 1.0}),
            InnerMoments(110, {"w": 2.0}),
            InnerMoments(1, {"w": 1e6}),  # a liar
            None,  # a donor that predates the description, or whose optimizer is not Adam's
        ]
        for d, moments in zip(donors, described, strict=True):
            d.inner_moments = moments
            d.publish(meta, tensors)
        report = FetchReport()
        got_meta, got = await fetch_state(joiner.host, joiner.ts, ids(donors), report=report, timeout=60)
        assert got_meta == meta and len(report.agreeing) == 4
        assert_same_state(tensors, got)
        assert report.inner_moments == InnerMoments(100, {"w": 2.0})  # the median of 1, 2 and the liar's


async def test_a_state_declined_from_its_manifest_moves_no_bytes_and_the_next_agreed_one_is_asked():
    """`accept` sees each agreed state's manifest (round, step) before a chunk is asked for: a
    joiner that could not enter with a state (a round old) no longer downloads it whole to find
    out — for a multi-GB state, on every retry until the swarm published a newer one."""
    async with AsyncExitStack() as stack:
        joiner, donors = await start_swarm(stack, 2)
        (meta, tensors), newer = make_state(512, seed=1, round=3), make_state(512, seed=2, round=4)
        for d in donors:
            d.publish({**meta, "step": 12}, tensors)
            d.publish({**newer[0], "step": 16}, newer[1])
        asked: list[tuple[int, int]] = []

        def accept(offer):
            asked.append((offer.round, offer.step))
            return None if offer.step < 16 else f"step {offer.step} is a round old"

        got_meta, got = await fetch_state(joiner.host, joiner.ts, ids(donors), accept=accept, timeout=60)
        assert asked == [(4, 16), (3, 12)] and got_meta["round"] == 3
        assert_same_state(tensors, got)
        served = [sum(d.bytes_served_to.values()) for d in donors]
        with pytest.raises(OfferDeclined, match="step 16 is a round old"):
            await fetch_state(joiner.host, joiner.ts, ids(donors), accept=lambda o: f"step {o.step} is a round old")
        assert [sum(d.bytes_served_to.values()) for d in donors] == served  # not a byte more
        # each donor knows the joiner asked for its newest state (it is fetching the swarm's state)
        assert all(d.states_taken[joiner.id] == 16 for d in donors)


async def test_download_straddling_a_round_boundary_finishes_the_older_round():
    async with AsyncExitStack() as stack:
        joiner, donors = await start_swarm(stack, 3, upload_limit=32 * MIB)
        meta3, state3 = make_state(2 << 10, seed=1, round=3)
        meta4, state4 = make_state(2 << 10, seed=2, round=4)
        for d in donors:
            d.publish(meta3, state3)

        def next_round_lands(done: int, total: int) -> None:
            if donors[0].rounds == [3]:
                for d in donors:
                    d.publish(meta4, state4)

        got_meta, got = await fetch_state(
            joiner.host, joiner.ts, ids(donors), chunk_bytes=128 * KIB, progress=next_round_lands
        )
        assert got_meta["round"] == 3
        assert_same_state(state3, got)
        assert donors[0].rounds == [4, 3]
        got_meta, got = await fetch_state(joiner.host, joiner.ts, ids(donors), chunk_bytes=128 * KIB)
        assert got_meta["round"] == 4  # the next join takes the newer round
        assert_same_state(state4, got)


async def test_lent_state_is_copied_at_a_round_only_while_a_joiner_fetches_it():
    """A lent snapshot costs no copy: one nobody fetches is dropped at `reclaim`; one a download
    is using is copied then (copy-on-write) and the download finishes on the copy, bit-exact,
    although the owner changes its tensors in place as soon as `reclaim` returns."""
    async with AsyncExitStack() as stack:
        joiner, donors = await start_swarm(stack, 2, upload_limit=16 * MIB)
        meta3, live = make_state(2 << 10, seed=1, round=3)
        expected = {k: t.clone() for k, t in live.items()}
        for d in donors:
            d.publish(meta3, live, live=True)
        for d in donors:  # a round nobody fetched: dropped, not copied
            await d.reclaim()
            assert d.rounds == [] and d.stats["bytes_copied"] == 0
            d.publish(meta3, live, live=True)
        meta4 = {**meta3, "round": 4}
        first_chunk = trio.Event()

        async def next_round_lands() -> None:
            await first_chunk.wait()
            for d in donors:
                await d.reclaim()
            for t in live.values():  # the owner's round changes its tensors in place
                if t.numel() and t.dtype.is_floating_point:
                    t.add_(1)
            for d in donors:
                d.publish(meta4, live, live=True)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(next_round_lands)
            got_meta, got = await fetch_state(
                joiner.host, joiner.ts, ids(donors), chunk_bytes=128 * KIB, progress=lambda *_: first_chunk.set()
            )
        assert got_meta["round"] == 3
        assert_same_state(expected, got)
        total = sum(t.numel() * t.element_size() for t in live.values())
        assert [d.stats["bytes_copied"] for d in donors] == [total, total]
        assert donors[0].rounds == [4, 3]
        got_meta, got = await fetch_state(joiner.host, joiner.ts, ids(donors), chunk_bytes=128 * KIB)
        assert got_meta["round"] == 4
        assert_same_state(live, got)


async def test_provider_is_polled_for_a_fresh_snapshot():
    async with AsyncExitStack() as stack:
        current = {"snap": make_state(256, round=1)}
        peers = await start_peers(stack, 2)
        StateDonor(peers[1].host, peers[1].ts, provider=lambda: current["snap"])
        meta, _ = await fetch_state(peers[0].host, peers[0].ts, [peers[1].id], chunk_bytes=64 * KIB)
        assert meta["round"] == 1
        current["snap"] = make_state(256, seed=5, round=2)
        meta, got = await fetch_state(peers[0].host, peers[0].ts, [peers[1].id], chunk_bytes=64 * KIB)
        assert meta["round"] == 2
        assert_same_state(current["snap"][1], got)


class StallingDonor(StateDonor):
    """Stalls (as if SIGSTOPped) on the first chunk it is asked for, then serves normally."""

    stalled = False

    async def _send_chunk(self, peer, tag, snap, start, end, chunk_digest):
        if not self.stalled:
            self.stalled = True
            await trio.sleep(20)  # sleep: the stall is what is tested (as if SIGSTOPped)
        await super()._send_chunk(peer, tag, snap, start, end, chunk_digest)


async def fetch_with_a_slow_first_donor(slow_cls, kib: int, upload_mib: int, **fetch_kw) -> tuple[str, FetchReport]:
    """Three donors of one `kib` KiB state, the first a `slow_cls`, each capped at `upload_mib`
    MiB/s: the state arrives bit-exact in under 5 s. Returns the slow donor's id and the report."""
    async with AsyncExitStack() as stack:
        joiner, donors = await start_swarm(
            stack, 3, donor_cls=[slow_cls, StateDonor, StateDonor], upload_limit=upload_mib * MIB
        )
        meta, tensors = make_state(kib)
        for d in donors:
            d.publish(meta, tensors)
        report = FetchReport()
        t0 = time.monotonic()
        _, got = await fetch_state(
            joiner.host, joiner.ts, ids(donors), chunk_bytes=256 * KIB, report=report, **fetch_kw
        )
        assert time.monotonic() - t0 < 5  # not the stall, nor the 60 s chunk timeout
        assert_same_state(tensors, got)
        return donors[0].host.peer_id, report


async def test_a_stalled_chunk_is_fetched_again_from_an_idle_donor_at_the_end():
    _, report = await fetch_with_a_slow_first_donor(StallingDonor, 4 << 10, 32)
    assert report.duplicated >= 1 and not report.banned


class StalledDonor(StateDonor):
    """Answers manifests, then never sends a chunk (as if SIGSTOPped once the transfer began)."""

    async def _send_chunk(self, peer, tag, snap, start, end, chunk_digest):
        await trio.sleep_forever()


async def test_a_donor_that_stalls_is_dropped_and_its_chunks_go_to_the_others_before_the_end_game():
    """A donor whose chunk handler never sends holds its two chunks; once the others have kept
    delivering for the stall interval it is dropped and its chunks re-queued — not after the
    60 s chunk timeout, and not only in the end game."""
    staller, report = await fetch_with_a_slow_first_donor(StalledDonor, 24 << 10, 8, stall_timeout=0.5)
    assert list(report.banned) == [staller] and "stalled" in report.banned[staller], report.banned
    assert report.requeued >= 1 and staller not in report.bytes_per_donor


class BrieflyStallingDonor(StallingDonor):
    """Stalls 2 s on its first chunk (a GC pause, a loaded machine), then serves normally."""

    async def _send_chunk(self, peer, tag, snap, start, end, chunk_digest):
        if not self.stalled:
            self.stalled = True
            await trio.sleep(2)  # sleep: the brief stall is what is tested
        await StateDonor._send_chunk(self, peer, tag, snap, start, end, chunk_digest)


async def test_a_lone_donor_that_stalls_is_waited_for_not_dropped():
    """The stall watchdog drops a donor only while another delivers: a lone donor's stall (four
    stall intervals here) is waited out — the chunk timeout, not the watchdog, decides when to
    give up on it."""
    async with AsyncExitStack() as stack:
        joiner, (donor,) = await start_swarm(stack, 1, donor_cls=BrieflyStallingDonor)
        meta, tensors = make_state(1 << 10)
        donor.publish(meta, tensors)
        report = FetchReport()
        _, got = await fetch_state(
            joiner.host, joiner.ts, [donor.host.peer_id], chunk_bytes=256 * KIB, report=report, stall_timeout=0.5
        )
        assert_same_state(tensors, got)
        assert donor.stalled and not report.banned, report.banned


class SilentManifestDonor(StateDonor):
    """Never answers a manifest request (as if SIGSTOPped before the vote)."""

    async def _serve_manifest(self, peer, request):
        await trio.sleep_forever()


async def test_one_of_two_donors_that_never_answers_its_manifest_holds_the_vote_only_a_grace_period():
    """A 10-minute soak's joiner waited 52 s for the manifest of one of its two donors (SIGSTOPped,
    then killed): the vote waited for a majority — both of two — up to the 60 s manifest
    timeout. Half of them answering, one with a state, starts the grace period (the stalled
    donor's answer could only have tied the vote)."""
    async with AsyncExitStack() as stack:
        joiner, donors = await start_swarm(stack, 2, donor_cls=[StateDonor, SilentManifestDonor])
        meta, tensors = make_state(256)
        for d in donors:
            d.publish(meta, tensors)
        report = FetchReport()
        t0 = trio.current_time()
        _, got = await fetch_state(joiner.host, joiner.ts, ids(donors), report=report)
        assert_same_state(tensors, got)
        assert report.answered == [donors[0].host.peer_id], report.answered
        assert trio.current_time() - t0 < MANIFEST_TIMEOUT / 4  # the grace (2 s here), not the timeout


# -- silent donors (fetch.py, "Silence") ---------------------------------------------------------


async def never_answers(sender: str, request: object) -> object:
    """A WHERE handler that never answers: a SIGSTOPped peer, as its prober sees it."""
    await trio.sleep_forever()


async def answers_at_once(sender: str, request: object) -> object:
    """A WHERE handler that answers from its loop at once: a live peer, whatever its transfers do."""
    return WhereReply(-1, None, -1).to_wire()


async def test_a_lone_donor_gone_silent_is_dropped_at_once_in_the_vote_and_mid_download():
    """A 30-minute soak's joiner sat 24 s in a download whose one donor was stopped or cut off
    (until it was killed): with one donor the stall rule waits for a second, and the timeouts are
    60 s. A donor whose heartbeats stopped (`quiet`) and that leaves a probe unanswered is silent:
    dropped within a few seconds, before its manifest (the vote fails) or mid-download (the
    download fails), and the node asks again from the members live now."""
    for donor_cls, raises, limit in [(SilentManifestDonor, NoDonors, 10.0), (StalledDonor, DonorsExhausted, 10.0)]:
        async with AsyncExitStack() as stack:
            joiner, (donor,) = await start_swarm(stack, 1, donor_cls=donor_cls)
            donor.host.rpc.serve(WHERE_RPC, never_answers)
            donor.publish(*make_state(256))
            report = FetchReport()
            t0 = trio.current_time()
            with pytest.raises(raises, match="silent"):
                await fetch_state(joiner.host, joiner.ts, [donor.host.peer_id], report=report, quiet=lambda p: True)
            assert trio.current_time() - t0 < limit  # PROBE_AFTER + a probe, not the 60 s timeouts
            assert "silent" in report.banned[donor.host.peer_id], report.banned


async def test_a_donor_that_answers_its_probe_is_waited_for_however_quiet_its_heartbeats():
    """Silence needs both signals: a donor whose heartbeats lag (a saturated uplink) but whose
    loop answers the probe is only slow — its 5 s stall on a chunk is waited out, not dropped."""

    class LongStallingDonor(StallingDonor):
        async def _send_chunk(self, peer, tag, snap, start, end, chunk_digest):
            if not self.stalled:
                self.stalled = True
                await trio.sleep(5)  # sleep: the stall, longer than a probe's round, is what is tested
            await StateDonor._send_chunk(self, peer, tag, snap, start, end, chunk_digest)

    async with AsyncExitStack() as stack:
        joiner, (donor,) = await start_swarm(stack, 1, donor_cls=LongStallingDonor)
        donor.host.rpc.serve(WHERE_RPC, answers_at_once)
        meta, tensors = make_state(256)
        donor.publish(meta, tensors)
        report = FetchReport()
        _, got = await fetch_state(joiner.host, joiner.ts, [donor.host.peer_id], report=report, quiet=lambda p: True)
        assert_same_state(tensors, got)
        assert donor.stalled and not report.banned, report.banned


async def test_a_donor_behind_a_stalled_connection_is_asked_again_over_a_fresh_one():
    """A 10-minute soak's re-sync waited 25 s for its one donor's manifest: the request went out
    over a connection that a partition had stalled (TCP's backed-off retransmissions), while the
    donor's heartbeats reached it through others' gossip — not quiet, so not silent. A donor that
    leaves its manifest and a probe unanswered while its heartbeats arrive is behind a stalled
    connection: it is closed, and the donor asked again over a fresh one (once)."""
    async with AsyncExitStack() as stack:
        joiner, (donor,) = await start_swarm(stack, 1)
        nursery = await stack.enter_async_context(trio.open_nursery())
        stack.callback(nursery.cancel_scope.cancel)
        relay = FreezingRelay(int(donor.host.addrs[0].split("/tcp/")[1].split("/")[0]))
        await nursery.start(relay.serve)
        await joiner.host.disconnect(donor.host.peer_id)
        await joiner.host.wait_until(lambda: not joiner.host.is_connected(donor.host.peer_id))
        await joiner.host.connect(f"/ip4/127.0.0.1/tcp/{relay.port}/p2p/{donor.host.peer_id}")
        assert relay.opened == 1
        meta, tensors = make_state(256)
        donor.publish(meta, tensors)
        relay.freeze()
        report = FetchReport()
        t0 = trio.current_time()
        _, got = await fetch_state(
            joiner.host, joiner.ts, [donor.host.peer_id], report=report, quiet=lambda p: False, manifest_timeout=40
        )
        assert_same_state(tensors, got)
        assert trio.current_time() - t0 < 15  # a probe's round and a fresh dial, not the 40 s timeout
        assert not report.banned and report.answered == [donor.host.peer_id]


# -- liars and failures --------------------------------------------------------------------------


class LeavingDonor(StateDonor):
    """Answers the manifest, then fails every chunk: a peer on its way out."""

    async def _send_chunk(self, peer, tag, snap, start, end, chunk_digest):
        raise TransferError("leaving the swarm")


class ColludingDonor(StateDonor):
    """Serves every chunk of the newest snapshot honestly but announces a made-up whole-state
    digest in its manifest (and answers chunk requests under it): with a second such donor the
    made-up manifest wins the vote, every chunk verifies, and only the final check sees it."""

    FAKE = bytes(range(32))

    async def _serve_manifest(self, peer, request):
        newest = max(self._snapshots, key=lambda s: s.round)
        for snap in self._snapshots:
            await snap.digests(request["chunk_bytes"])
        _, chunks = newest.cached(request["chunk_bytes"])
        newest._digests[request["chunk_bytes"]] = (self.FAKE, chunks)
        return await super()._serve_manifest(peer, request)


@pytest.mark.parametrize(
    ("failing", "why"),
    [(LeavingDonor, "leaving"), (ColludingDonor, "whole-state digest")],
    ids=["leaving", "colluding"],
)
async def test_when_every_donor_of_the_newest_round_fails_the_next_agreed_round_is_fetched(failing, why):
    """Two donors offer rounds 9 and 5; a third offers round 5 only. Round 9 (agreed by two of
    three) is tried first, and its two donors fail it: they fail every chunk (leaving), or serve
    every chunk honestly under a made-up whole-state digest (colluding: every chunk verifies, the
    whole does not, and both are dropped together). The download falls back to round 5 (agreed by
    all three), fetched from the third donor."""
    async with AsyncExitStack() as stack:
        joiner, donors = await start_swarm(stack, 3, donor_cls=[failing, failing, StateDonor])
        older, newer = make_state(512, seed=1, round=5), make_state(512, seed=2, round=9)
        for d in donors:
            d.publish(*older)
        for d in donors[:2]:
            d.publish(*newer)
        report = FetchReport()
        got_meta, got = await fetch_state(joiner.host, joiner.ts, ids(donors), chunk_bytes=64 * KIB, report=report)
        assert got_meta["round"] == 5 and report.round == 5 and report.abandoned == [9]
        assert_same_state(older[1], got)
        assert set(report.banned) == set(ids(donors[:2])) and report.agreeing == ids(donors[2:])
        assert all(why in reason for reason in report.banned.values()), report.banned
        assert report.bytes_per_donor[donors[2].host.peer_id] == report.total_bytes  # (colluders: round 9's too)


async def test_the_fallback_never_takes_a_state_the_vote_did_not_agree_on():
    """As above, but the older round is offered by the third donor alone: one of three is no
    quorum, so the download fails rather than trust it, and that donor is never asked for a chunk."""
    async with AsyncExitStack() as stack:
        joiner, donors = await start_swarm(stack, 3, donor_cls=[LeavingDonor, LeavingDonor, StateDonor])
        donors[2].publish(*make_state(512, seed=1, round=5))
        for d in donors[:2]:
            d.publish(*make_state(512, seed=2, round=9))
        report = FetchReport()
        with pytest.raises(DonorsExhausted, match="rounds tried: 9"):
            await fetch_state(joiner.host, joiner.ts, ids(donors), chunk_bytes=64 * KIB, report=report)
        assert report.round == 9 and report.abandoned == [] and donors[2].stats["chunks_served"] == 0
        # With a quorum of one (a pipeline stage's fallback), the same swarm gives round 5.
        got_meta, _ = await fetch_state(joiner.host, joiner.ts, ids(donors), chunk_bytes=64 * KIB, min_agree=1)
        assert got_meta["round"] == 5


@pytest.mark.parametrize(
    "liar", [CorruptingDonor, AnnouncingCorruptingDonor], ids=["silent-digest", "announced-digest"]
)
async def test_late_joiner_digest_check_rejects_a_tampered_donor(liar):
    async with AsyncExitStack() as stack:
        joiner, donors = await start_swarm(stack, 4, donor_cls=[liar, StateDonor, StateDonor, StateDonor])
        meta, tensors = make_state(4 << 10)
        for d in donors:
            d.publish(meta, tensors)
        report = FetchReport()
        _, got = await fetch_state(joiner.host, joiner.ts, ids(donors), chunk_bytes=256 * KIB, report=report)
        assert_same_state(tensors, got)
        bad = donors[0].host.peer_id
        assert bad in report.agreeing  # its manifest was honest: it was asked for chunks ...
        assert bad in report.banned and "digest" in report.banned[bad].lower()  # ... and caught
        assert bad not in report.bytes_per_donor
        assert report.requeued >= 1


@pytest.mark.parametrize("claim", ["same-round", "newer-round"])
async def test_a_donor_lying_in_its_manifest_is_outvoted(claim):
    async with AsyncExitStack() as stack:
        joiner, donors = await start_swarm(stack, 4)
        meta, tensors = make_state(1 << 10)
        fake_meta, fake = make_state(1 << 10, seed=66, round=3 if claim == "same-round" else 99)
        donors[0].publish(fake_meta, fake)
        for d in donors[1:]:
            d.publish(meta, tensors)
        report = FetchReport()
        got_meta, got = await fetch_state(joiner.host, joiner.ts, ids(donors), chunk_bytes=128 * KIB, report=report)
        assert got_meta == meta
        assert_same_state(tensors, got)
        assert donors[0].host.peer_id not in report.agreeing
        assert donors[0].stats["chunks_served"] == 0


async def test_no_majority_is_a_clear_error():
    async with AsyncExitStack() as stack:
        joiner, donors = await start_swarm(stack, 2)
        donors[0].publish(*make_state(256, seed=1))
        donors[1].publish(*make_state(256, seed=2))
        with pytest.raises(NoAgreement, match="majority|identically") as e:
            await fetch_state(joiner.host, joiner.ts, ids(donors), chunk_bytes=64 * KIB)
        assert isinstance(e.value, StateSyncError) and isinstance(e.value, MeshtrainError)


async def test_no_donors_and_donors_without_state_are_clear_errors():
    async with AsyncExitStack() as stack:
        joiner, donors = await start_swarm(stack, 2)
        with pytest.raises(NoDonors, match="no donors"):
            await fetch_state(joiner.host, joiner.ts, [])
        with pytest.raises(NoDonors, match="no_state"):
            await fetch_state(joiner.host, joiner.ts, ids(donors))


async def test_states_under_keys_are_served_apart():
    """A donor offers several states side by side (a pipeline peer: one per stage it held); a
    joiner gets the one under the key it asks for, and a key nobody published is `no_state`."""
    async with AsyncExitStack() as stack:
        joiner, donors = await start_swarm(stack, 2)
        stage1, stage2 = make_state(96, seed=1, round=7), make_state(128, seed=2, round=9)
        for d in donors:
            d.publish(*stage1, key="pipeline/stage1")
            d.publish(*stage2, key="pipeline/stage2")
        donors[0].publish(*make_state(64, seed=3))  # the default key: another state again
        meta, got = await fetch_state(joiner.host, joiner.ts, ids(donors), chunk_bytes=64 * KIB, key="pipeline/stage2")
        assert meta["round"] == 9 and donors[0].keyed_rounds("pipeline/stage2") == [9]
        assert_same_state(stage2[1], got)
        meta, got = await fetch_state(joiner.host, joiner.ts, ids(donors), chunk_bytes=64 * KIB, key="pipeline/stage1")
        assert_same_state(stage1[1], got)
        with pytest.raises(NoDonors, match="no_state"):
            await fetch_state(joiner.host, joiner.ts, ids(donors), key="pipeline/stage3")


async def test_malformed_requests_get_typed_errors_and_the_donor_keeps_serving():
    async with AsyncExitStack() as stack:
        joiner, (donor,) = await start_swarm(stack, 1)
        meta, tensors = make_state(512)
        donor.publish(meta, tensors)
        call = joiner.host.rpc.call
        for bad in (
            5,
            None,
            [],
            {"chunk_bytes": "8"},
            {"chunk_bytes": True},
            {"chunk_bytes": 1},
            {"chunk_bytes": 1 << 40},
        ):
            with pytest.raises(RemoteError) as e:
                await call(donor.host.peer_id, MANIFEST_RPC, bad)
            assert e.value.code == "bad_request", bad
        manifest = (await call(donor.host.peer_id, MANIFEST_RPC, {"chunk_bytes": 64 * KIB}))["snapshots"][0]
        good = {"digest": manifest["digest"], "chunk_bytes": 64 * KIB, "index": 0, "fetch": "ab12"}
        cases = [
            ("bad_request", "not a map"),
            ("bad_request", {}),
            ("bad_request", {**good, "digest": b"short"}),
            ("bad_request", {**good, "index": "0"}),
            ("bad_request", {**good, "index": True}),
            ("bad_request", {**good, "index": -1}),
            ("bad_request", {**good, "index": len(manifest["chunks"])}),
            ("bad_request", {**good, "fetch": "../../etc"}),
            ("bad_request", {**good, "fetch": "x" * 5000}),
            ("unknown_state", {**good, "digest": os.urandom(32)}),
            ("unknown_state", {**good, "chunk_bytes": 128 * KIB}),  # no manifest for that size
        ]
        for code, req in cases:
            with pytest.raises(RemoteError) as e:
                await call(donor.host.peer_id, CHUNK_RPC, req)
            assert e.value.code in (code, "malformed"), (req, e.value)
        got_meta, got = await fetch_state(joiner.host, joiner.ts, [donor.host.peer_id], chunk_bytes=64 * KIB)
        assert got_meta == meta
        assert_same_state(tensors, got)
        assert donor.stats["requests_refused"] >= 16


@pytest.mark.slow
async def test_donor_killed_mid_transfer_the_others_finish():
    """A real donor process is SIGKILLed once it has delivered a couple of chunks; its chunks go
    to the two donors left and the state still arrives bit-exact."""
    kib, limit = 24 << 10, 8
    victim = spawn(
        "tests/proc_donor.py", "--kib", str(kib), "--upload-mib", str(limit), "--chunk-bytes", str(512 * KIB)
    )
    try:
        async with AsyncExitStack() as stack:
            joiner, donors = await start_swarm(stack, 2, upload_limit=limit * MIB)
            meta, tensors = make_state(kib)
            for d in donors:
                d.publish(meta, tensors)
            info = await trio.to_thread.run_sync(read_json, victim)
            await joiner.host.connect(info["addr"])
            report = FetchReport()

            def kill_victim_mid_transfer(done: int, total: int) -> None:
                if victim.poll() is None and report.chunks_per_donor.get(info["peer"], 0) >= 2:
                    os.kill(victim.pid, signal.SIGKILL)

            t0 = time.monotonic()
            got_meta, got = await fetch_state(
                joiner.host,
                joiner.ts,
                [info["peer"], *ids(donors)],
                chunk_bytes=512 * KIB,
                progress=kill_victim_mid_transfer,
                report=report,
                timeout=60,
            )
            assert victim.wait(5) == -signal.SIGKILL
            assert got_meta == meta
            assert_same_state(tensors, got)
            assert info["peer"] in report.agreeing and info["peer"] in report.banned
            assert 0 < report.bytes_per_donor[info["peer"]] < report.total_bytes // 2
            assert time.monotonic() - t0 < 30
    finally:
        if victim.poll() is None:
            victim.kill()
        victim.wait()


# -- chunking ------------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 3000), max_size=12),
    chunk=st.integers(1, 4000),
    order=st.randoms(use_true_random=False),
)
def test_chunks_cover_the_flattened_state_exactly_once(sizes, chunk, order):
    g = torch.Generator().manual_seed(len(sizes) * 7919 + chunk)
    src = FlatState({f"t{i}": torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8) for i, n in enumerate(sizes)})
    ranges = chunk_ranges(src.total, chunk)
    assert [s for s, _ in ranges] == list(range(0, src.total, chunk))
    assert all(e - s == min(chunk, src.total - s) > 0 for s, e in ranges)
    covered = [torch.zeros(n, dtype=torch.int32) for n in sizes]
    for s, e in ranges:
        pieces = src.pieces(s, e)
        assert sum(n for _, _, n in pieces) == e - s and all(n > 0 for _, _, n in pieces)
        for i, off, n in pieces:
            covered[i][off : off + n] += 1
    assert all(bool((c == 1).all()) for c in covered)
    # Reassembly in any order is the identity, and the digests agree with the whole-state one.
    dst = FlatState({f"t{i}": torch.zeros(n, dtype=torch.uint8) for i, n in enumerate(sizes)})
    shuffled = list(ranges)
    order.shuffle(shuffled)
    for s, e in shuffled:
        dst.write(s, byte_views(src.slices(s, e)))
    whole, chunk_digests = src.digests(chunk)
    assert dst.digest() == whole == src.digest() == payload_digest(src.tensors)
    flat = b"".join(bytes(v) for v in src.views)
    assert chunk_digests == [blake3.blake3(flat[s:e]).digest() for s, e in ranges]
