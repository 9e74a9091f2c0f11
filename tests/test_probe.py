"""The silence probe (collective/probe.py) over real hosts on loopback: a peer that leaves a WHERE
probe unanswered may be silent — unless our own loop ran late past the probe's deadline, when the
answer may be lying unread and the probe proves nothing; and a data phase's watch over a member
SIGSTOPped in its own process."""

from __future__ import annotations

import os
import signal
import time
from contextlib import AsyncExitStack

import pytest
import torch
import trio

from meshtrain.collective.contribution import Contribution
from meshtrain.collective.data_phase import AttemptFailed, AttemptPlan, DataPhase
from meshtrain.collective.probe import LATE_S, QUIET_S, WATCH_EVERY, Whereabouts, probe_where, wait_silent
from meshtrain.collective.protocol import (
    PROBE_AFTER,
    PROBE_EVERY,
    WHERE_RPC,
    AllReduceConfig,
    Joined,
    RoundKey,
    WhereReply,
)
from meshtrain.transport.identity import KEY_FILE_NAME, Identity

from .conftest import read_json, spawn, start_peers
from .test_allreduce import connected_peers


async def stopped(sender: str, request: object) -> object:
    """A WHERE handler that never answers: a SIGSTOPped peer, as its prober sees it."""
    await trio.sleep_forever()


async def test_an_unanswered_probe_may_be_silence_but_not_when_our_own_loop_ran_late():
    async with AsyncExitStack() as stack:
        us, them = await connected_peers(stack, 2)
        them.host.rpc.serve(WHERE_RPC, stopped)
        # Our loop on time: the deadline passed with no answer, and the peer may be silent.
        assert await probe_where(us.host, them.id, "f0", 7) is True

        # Our loop starved past the deadline (a loaded machine; in-process peers share one
        # loop): the unanswered probe proves nothing of the peer.
        verdict: list[object] = []

        async def probe() -> None:
            verdict.append(await probe_where(us.host, them.id, "f0", 7))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(probe)
            await trio.sleep(0.1)  # sleep: the probe is out
            time.sleep(PROBE_EVERY + 2 * LATE_S)  # sleep: blocks our loop past the deadline, what is tested
        assert verdict == [False]


async def test_a_probe_out_before_the_heartbeats_stop_makes_the_peer_silent_as_they_stop():
    """Silence is a probe unanswered for `PROBE_EVERY` and heartbeats stopped — in either order.
    Until stop 66 only a probe sent once the heartbeats had stopped counted, so a peer stopped a
    moment after its last heartbeat was found at the end of the next probe, up to 4 s after the
    heartbeat rule (an H 100 soak's data phase: 9.4 s after the stop). Here the heartbeats stop
    5 s into the watch, a probe having been out since 2 s: silent at 5 s and a look."""
    async with AsyncExitStack() as stack:
        us, them = await connected_peers(stack, 2)
        them.host.rpc.serve(WHERE_RPC, stopped)
        t0 = trio.current_time()
        silent = await wait_silent(us.host, lambda: [them.id], lambda p: trio.current_time() - t0 > 5.0)
        assert silent == {them.id}
        assert trio.current_time() - t0 < 5.0 + WATCH_EVERY + LATE_S  # before: 8 s (a probe from 6 s)


@pytest.mark.parametrize("heartbeats", ["stopped", "sparse"])
async def test_a_member_stopped_before_the_attempt_connects_fails_it_for_silence_not_the_part_deadline(
    tmp_path, heartbeats
):
    """A 30-minute soak's retry waited 7 s on a member SIGSTOPped since the attempt before: the
    data phase opens its connections first (a stopped process's kernel accepts what the process
    never answers) and watched for silence only once they were open — after the part deadline
    (20 s). The watch runs from the attempt's start: a member whose heartbeats stopped (`quiet`)
    and that leaves a probe unanswered fails the attempt within seconds, named as the suspect.
    `sparse`: in a large swarm heartbeats come every 10–30 s, so a stopped member's last one is
    still recent (`quiet` false); it leaves a patient probe unanswered for `QUIET_S` and is silent
    all the same (before: the attempt failed at the connection deadline, "unreachable")."""
    key = tmp_path / KEY_FILE_NAME
    Identity.generate().save(key)
    proc = spawn("tests/proc_peer.py", "silent", "--key", str(key), stderr_path=str(tmp_path / "silent.log"))
    try:
        hello = read_json(proc)
        async with AsyncExitStack() as stack:
            (us,) = await start_peers(stack, 1)
            await us.host.connect(hello["addr"])
            os.kill(proc.pid, signal.SIGSTOP)
            config = AllReduceConfig()
            group = (us.id, hello["peer"])
            plan = AttemptPlan.of(RoundKey(7, "outer", us.id), Joined(0, group), us.id, 1024, config, "none")
            contribution = Contribution({"w": torch.ones(1024)}, 1.0, 7)
            t0 = trio.current_time()
            async with trio.open_nursery() as nursery:
                contribution.start(nursery)
                quiet = heartbeats == "stopped"
                phase = DataPhase(us.ts, us.host, config, plan, contribution, quiet=lambda p: quiet)
                with pytest.raises(AttemptFailed, match="silent") as failed:
                    await phase.run()
            assert failed.value.suspects == {hello["peer"]}
            # a probe's round (a patient one's, QUIET_S, where heartbeats are sparse), not the deadline
            assert trio.current_time() - t0 < (config.part_timeout / 2 if quiet else PROBE_AFTER + QUIET_S + 3)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()


def test_whereabouts_read_each_missing_peers_answer_once():
    """How a coordinator reads its missing peers' answers (probe.py `Whereabouts`): round 150 of
    series "f0" at coordinator "m", round window 64; `trains` says who reports progress now."""
    key = RoundKey(150, "f0", "m")
    answers = {
        "regrouped": WhereReply(150, "m", 140, "f0~g1.2"),
        "passed": WhereReply(-1, None, 150),
        "ahead": WhereReply(170, "m", 160),
        "lower": WhereReply(150, "a", 140),
        "stopped": WhereReply(40, "m", 30),  # further behind than the window
        "resyncing": WhereReply(-1, None, 110),  # behind, inside the window, not training
        "coming": WhereReply(-1, None, 130),  # behind, inside the window, training
        "fetching": WhereReply(-1, None, -1),  # no round in this life, not training
        "starting": WhereReply(-1, None, -1),  # the same, but training (its first steps)
    }
    trains = {"coming", "starting"}.__contains__
    found = Whereabouts.of(answers, key, "m", 64, trains=trains, rounds_ended=True, waited=True)
    assert found.regrouped == {"regrouped": "f0~g1.2"}
    assert found.passed == {"passed", "ahead"}
    assert found.elsewhere == {"lower": "a"}
    assert found.behind == {"stopped", "resyncing"}
    assert found.fetching == {"fetching"}
    # At a swarm's start (no round ended here) or before the short wait, a peer with no round is
    # starting, or may still make the round: not fetching. Without progress records, only the
    # window tells.
    for rounds_ended, waited in ((False, True), (True, False)):
        assert not Whereabouts.of(
            answers, key, "m", 64, trains=trains, rounds_ended=rounds_ended, waited=waited
        ).fetching
    bare = Whereabouts.of(answers, key, "m", 64)
    assert bare.behind == {"stopped"} and not bare.fetching
