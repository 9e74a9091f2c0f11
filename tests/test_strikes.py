"""Strikes: screening flags become signed, replicated strikes; a peer struck in
`spec.verification.strikes` rounds by enough reporters each (half the others, at least two) is excluded everywhere; forged strikes change nothing;
strikes survive a restart and reach a late joiner.

Real `PeerPresence`s (DHT, CRDT replica, admission) on loopback hosts in one trio program. Flags
enter where the collective hands them over (`StrikeBook.on_round`, a `RoundScreening`), so these
tests need no training; tests/test_adversary_swarm.py runs the whole path through real nodes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import trio

from meshtrain import SignedSpec, SwarmSpec
from meshtrain.collective.contract import ContributionFlag, RoundScreening
from meshtrain.crdt.record_gate import REFUSED_NOT_A_MEMBER
from meshtrain.crdt.strikes import ECHO, Strike
from meshtrain.crdt.swarm_view import STRIKES
from meshtrain.crdt.types import LWWRegister
from meshtrain.node.presence import PeerPresence
from meshtrain.node.trust.admission import EXCLUDED, pow_ok
from meshtrain.node.trust.strikes import (
    LINEAGE_PASSES,
    STRIKES_FILE,
    LossScore,
    Standing,
    lineage_passes,
    loss_flagged,
)
from meshtrain.transport.host import Host, HostConfig
from meshtrain.transport.identity import Identity

pytestmark = pytest.mark.slow

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
DIGEST = b"\x01" * 32


async def until(check: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    with trio.fail_after(timeout):
        while not check():
            await trio.sleep(0.05)  # sleep: poll interval
    assert check(), what


def saved(p: PeerPresence) -> bool:
    """Whether `p`'s strikes file holds every strike entry its replica holds."""
    path = p.strikes.path
    if path is None or not path.exists():
        return False
    kept = LWWRegister.decode_entries(path.read_bytes())
    return sorted((e.owner, e.seq) for e in kept) == sorted(
        (e.owner, e.seq) for e in p.view.replica.crdt(STRIKES).entries()
    )


def swarm_spec(owner: Identity) -> SignedSpec:
    return SignedSpec.create(SwarmSpec(model="gpt-tiny", pow_bits=4, strikes=3), owner)


async def presence(
    stack: AsyncExitStack,
    signed: SignedSpec,
    identity: Identity,
    *,
    entry: str | None,
    data_dir: Path | None = None,
    pow_nonce: int | None = None,
) -> PeerPresence:
    host = await stack.enter_async_context(Host(identity, HostConfig(listen=LOOPBACK)))
    p = PeerPresence(host, signed, bootstrap=[entry] if entry else [], data_dir=data_dir, pow_nonce=pow_nonce)
    await stack.enter_async_context(p)
    assert p.view is not None
    p.view.role = "trainer"
    p.view.heartbeat()
    return p


async def swarm(stack: AsyncExitStack, n: int, tmp: Path) -> tuple[SignedSpec, list[PeerPresence]]:
    ids = [Identity.generate() for _ in range(n)]
    signed = swarm_spec(ids[0])
    peers = [await presence(stack, signed, ids[0], entry=None, data_dir=tmp / "p0")]
    entry = peers[0].host.addrs[0]
    for i, ident in enumerate(ids[1:], 1):
        peers.append(await presence(stack, signed, ident, entry=entry, data_dir=tmp / f"p{i}"))
    for p in peers:  # a full mesh, every record everywhere
        await until(lambda p=p: len(p.trainers()) == n and len(p.candidates()) == n, "all see all")
    return signed, peers


def flagged(reporter: PeerPresence, group: list[PeerPresence], peer: str, rnd: int, **scores: float) -> RoundScreening:
    """What the collective hands `reporter` after round `rnd` when it flagged `peer` as an owner."""
    ids = tuple(sorted(p.me for p in group))
    flag = ContributionFlag(peer, ids.index(reporter.me), scores.get("norm", 10.0), scores.get("align", -1.0), "norm")
    return RoundScreening(rnd, "", ids, DIGEST, (flag,))


async def test_two_reporters_in_three_rounds_exclude_a_peer_everywhere(tmp_path) -> None:
    async with AsyncExitStack() as stack:
        signed, peers = await swarm(stack, 4, tmp_path)
        a, b, c, x = peers
        for rnd in (1, 2):
            b.strikes.on_round(flagged(b, peers, x.me, rnd))
            c.strikes.on_round(flagged(c, peers, x.me, rnd))
        await until(lambda: all(p.standing().get(x.me) is not None for p in (a, b, c)), "strikes replicate")
        assert all(p.standing()[x.me].rounds == 2 and not p.standing()[x.me].excluded for p in (a, b, c))
        assert all(x.me in p.candidates() for p in peers)
        b.strikes.on_round(flagged(b, peers, x.me, 3))
        c.strikes.on_round(flagged(c, peers, x.me, 3))
        await until(lambda: all(p.strikes.excluded(x.me) for p in peers), "excluded everywhere")
        for p in (a, b, c):  # no round, no state, no data plane with it
            assert x.me not in p.candidates() and x.me not in p.trainers()
            assert not p.view.is_live(x.me)  # is_member's answer, without its wait for a record
            assert x.me in p.ignored()
            assert {q: s.excluded for q, s in p.standing().items()} == {x.me: True}  # honest peers: no standing
        assert not await a.is_member(x.me)
        assert x.not_admitted() == EXCLUDED  # and it knows


def test_lineage_passes_leave_a_window_room_for_its_strikes() -> None:
    def passes(strikes: int, window: int) -> int:
        return lineage_passes(SwarmSpec(model="gpt-tiny", strikes=strikes, strikes_window=window))

    assert passes(3, 6) == LINEAGE_PASSES == 3
    assert passes(3, 4) == 1 and passes(3, 3) == 0  # the window's other rounds can still reach `strikes`
    assert passes(3, 0) == LINEAGE_PASSES  # no window: passes for the whole run


async def test_loss_verdicts_on_a_peer_on_another_phi_lineage_are_passed_over_in_a_few_rounds(tmp_path) -> None:
    """A peer whose published φ differs from ours trains from another state: its honest update
    fails loss scoring measured on our φ (a chaos soak struck the creator out that way, while its
    parity check was about to re-sync it). Its flagged verdicts are passed over in up to
    `lineage_passes` rounds of a strikes window and filed past them: a peer that keeps publishing
    another φ (or lies about it) gains a delay, not a pass. Once the digests agree, verdicts are
    filed at once."""
    async with AsyncExitStack() as stack:
        signed, peers = await swarm(stack, 4, tmp_path)
        a, b, c, x = peers
        ours, theirs, next_round = b"\x0a" * 16, b"\x0b" * 16, b"\x0c" * 16
        for p in (a, b, c):
            p.view.report_progress(outer_round=5, phi=[(5, ours)])
        x.view.report_progress(outer_round=5, phi=[(5, theirs)])
        await until(lambda: b.view.progress().get(x.me) is not None and b.view.progress()[x.me].phi, "digests")
        ids = tuple(sorted(p.me for p in peers))
        verdict = LossScore(x.me, gain=-0.05, ref=0.01, norm_ratio=1.0, alignment=0.9)
        assert loss_flagged(verdict.gain, verdict.ref, signed.spec)

        def filed_by_b() -> list:
            return [s for r in b.view.strike_records() if r.reporter == b.me for s in r.strikes if s.peer == x.me]

        assert b.strikes.other_lineage(x.me) and not b.strikes.other_lineage(c.me)
        H, window = signed.spec.outer.H, signed.spec.verification.strikes_window

        def verdict_in(round_id: int, *, screened: bool = True) -> None:
            if screened:  # the round as its owner screened it (x in its group), before loss scoring's verdict
                b.strikes.on_round(RoundScreening(round_id, "", ids, DIGEST))
            b.strikes.on_scores(RoundScreening(round_id, "", ids, DIGEST), [verdict])

        passed = [100 + i * H for i in range(lineage_passes(signed.spec))]
        for r in passed:
            verdict_in(r)
        verdict_in(passed[0], screened=False)  # a late verdict of the first round: passed over again
        assert filed_by_b() == [] and b.strikes.passed_over == len(passed) + 1 == 4
        past = passed[-1] + H  # x held another φ in the window's 3 rounds before this one
        verdict_in(past)
        await until(lambda: [s.round_id for s in filed_by_b()] == [past], "filed past the passes")
        # A peer back on another φ after a window without: passed over again.
        later = past + 2 * window * H
        verdict_in(later)
        assert b.strikes.passed_over == 5 and [s.round_id for s in filed_by_b()] == [past]

        for p in peers:  # x re-synced: the same φ after the next round
            p.view.report_progress(outer_round=6, phi=[(5, theirs if p is x else ours), (6, next_round)])
        await until(lambda: not b.strikes.other_lineage(x.me), "x's new digest arrives")
        verdict_in(later + H)
        assert [s.round_id for s in filed_by_b()] == [past, later + H]


async def test_strikes_spread_over_a_long_run_exclude_nobody_and_a_run_of_them_does(tmp_path) -> None:
    """Chance flags of an honest peer far apart add up to nothing (`strikes_window`, 6 rounds of
    H = 50 steps here); `strikes` counted rounds within the window exclude it."""
    async with AsyncExitStack() as stack:
        signed, peers = await swarm(stack, 3, tmp_path)
        a, b, x = peers
        assert signed.spec.verification.strikes_window == 6 and signed.spec.outer.H == 50
        for rnd in (50, 1000, 2000):  # counted, but never 3 within 6 rounds
            a.strikes.on_round(flagged(a, peers, x.me, rnd))
            b.strikes.on_round(flagged(b, peers, x.me, rnd))
        await until(lambda: all(p.standing().get(x.me, Standing(x.me, 0, False)).rounds == 3 for p in peers), "count")
        assert not any(p.strikes.excluded(x.me) for p in peers) and all(x.me in p.candidates() for p in (a, b))
        for rnd in (2100, 2250):  # with 2000: three within 6 rounds (2000..2250)
            a.strikes.on_round(flagged(a, peers, x.me, rnd))
            b.strikes.on_round(flagged(b, peers, x.me, rnd))
        await until(lambda: all(p.strikes.excluded(x.me) for p in peers), "excluded everywhere")


async def test_forged_strikes_change_nothing(tmp_path) -> None:
    async with AsyncExitStack() as stack:
        signed, peers = await swarm(stack, 5, tmp_path)
        a, h, m, n, x = peers  # h: the honest victim; m, n: admitted liars; x: a bystander
        # A stranger without a valid proof of work: its view writes records nobody admits.
        stranger = Identity.generate()
        bad = next(k for k in range(10_000) if not pow_ok(signed.swarm_id, stranger.peer_id_str, k, 4))
        outsider = await presence(stack, signed, stranger, entry=a.host.addrs[0], pow_nonce=bad)
        await until(lambda: outsider.me in a.ignored(), "the outsider's record arrives")

        # 1. One admitted liar alone, three rounds, against the owner a: one reporter of a group of
        #    five counts for nothing (the quorum is two).
        for rnd in (1, 2, 3):
            m.strikes.on_round(flagged(m, peers, a.me, rnd))
        # 2. Against h, in groups of six with the outsider: m, n and the outsider would make the
        #    quorum (three), but the outsider is not admitted (no proof of work): nothing counts.
        outsider_group = [*peers, outsider]
        for rnd in (1, 2, 3):
            for liar in (m, n, outsider):
                liar.strikes.on_round(flagged(liar, outsider_group, h.me, rnd))
        # 3. Two admitted liars against x, without evidence: scores that break no threshold.
        for rnd in (4, 5, 6):
            for liar in (m, n):
                liar.strikes.on_round(flagged(liar, peers, x.me, rnd, norm=1.1, align=0.8))
        # 4. Two admitted liars against x about a round h took part in, with a digest h never saw.
        h.strikes.on_round(RoundScreening(7, "", tuple(sorted(p.me for p in peers)), b"\x07" * 32))
        for liar in (m, n):
            liar.strikes.on_round(flagged(liar, peers, x.me, 7))
        # 5. m's record passed off as n's (a bad signature), and a record whose reporter is not in
        #    its group: every replica refuses both.
        crdt = m.view.replica.crdt(STRIKES).copy()
        entry = crdt.entry(m.me)
        forged = dataclasses.replace(entry, owner=n.me, seq=entry.seq + 50)
        bogus = LWWRegister(crdt.namespace, crdt.name).set(
            m.view.replica.identity,
            {"strikes": [{**entry.body[1]["strikes"][0], "group": sorted(p.me for p in (a, h, x))}], "caps": {}},
        )
        for p in (a, h, x):
            outcome = p.view.replica.merge_entries(STRIKES, [forged, bogus], "gossip", m.me)
            assert not outcome.accepted and len(outcome.rejected) == 2
        # The admitted liars' records replicate; the outsider's is not even stored (not a member:
        # the replica's gate refuses it, crdt/swarm_view.py).
        await until(lambda: len(a.view.strike_records()) == 2, "the liars' records replicate")
        await until(lambda: all(len(p.view.strike_records()) == 2 for p in (a, h, x)), "everywhere")
        await until(
            lambda: all(p.view.replica.stats.refusals_by_reason.get(REFUSED_NOT_A_MEMBER) for p in (a, h, x)),
            "the outsider's strikes refused",
        )
        assert all(outsider.me not in {r.reporter for r in p.view.strike_records()} for p in (a, h, x))
        await trio.sleep(1.0)  # sleep: time for a wrong count to show; below, what must not happen
        for p in (a, h, x):
            assert a.me not in p.standing() and h.me not in p.standing()  # nothing counted against them
            # x: only round 7 counts, and only where nobody saw that round otherwise (h did)
            assert p.standing().get(x.me) == (None if p is h else Standing(x.me, 1, False))
        for p in (a, h, m, n, x):
            for victim in (a, h, x):
                assert not p.strikes.excluded(victim.me) and victim.me in p.candidates()
                assert victim.not_admitted() is None
        # 6. An echo strike (replay screening) counts only with a cosine past the spec's screen_echo.
        ids = tuple(sorted(p.me for p in peers))
        echo = Strike(m.me, 20, "", x.me, ids, DIGEST, ids.index(m.me), 1.0, 0.9, ECHO, echo=0.99, earlier=19)
        assert a.strikes.why_not_counted(echo, True) == "no evidence: the echo's cosine breaks no threshold"
        assert a.strikes.why_not_counted(dataclasses.replace(echo, echo=1.0), True) is None


async def test_strikes_survive_a_restart_and_reach_a_late_joiner(tmp_path) -> None:
    ids = [Identity.generate() for _ in range(4)]
    signed = swarm_spec(ids[0])
    async with AsyncExitStack() as stack:
        peers = [await presence(stack, signed, ids[0], entry=None, data_dir=tmp_path / "p0")]
        entry = peers[0].host.addrs[0]
        for i in (1, 2, 3):
            peers.append(await presence(stack, signed, ids[i], entry=entry, data_dir=tmp_path / f"p{i}"))
        for p in peers:
            await until(lambda p=p: len(p.trainers()) == 4, "all see all")
        a, b, c, x = peers
        for rnd in (1, 2, 3):
            b.strikes.on_round(flagged(b, peers, x.me, rnd))
            c.strikes.on_round(flagged(c, peers, x.me, rnd))
        await until(lambda: a.strikes.excluded(x.me), "a excludes x")
        # A late joiner pulls the strikes with the rest of the swarm's state.
        late = await presence(stack, signed, Identity.generate(), entry=entry, data_dir=tmp_path / "late")
        await until(lambda: late.strikes.excluded(x.me), "the late joiner excludes x")
        assert x.me not in late.candidates() and late.standing()[x.me].rounds == 3
        assert a.strikes.path == tmp_path / "p0" / STRIKES_FILE
        await until(lambda: saved(a), "a keeps the strikes on disk, the last change too")
    # The whole swarm is gone; the owner restarts alone, with its data dir: the verdict stands.
    async with AsyncExitStack() as stack:
        alone = await presence(stack, signed, ids[0], entry=None, data_dir=tmp_path / "p0")
        assert alone.strikes.excluded(x.me) and alone.standing()[x.me].rounds == 3
        assert len(alone.view.strike_records()) == 2
