"""A coordinator's own pauses, and whether its peers stayed through them.

The problem. A coordinator that was itself stopped (SIGSTOP, a suspended VM, a loop blocked for
seconds) was silent to its members: those who noticed restarted the round at the next candidate
and may complete it there. Their joins and reports are still here when we resume, and runs of
three real daemons saw the lowest id, stopped 12 s, resume and either fix the group of three with
its own trainer's late join (then wait out the data phase for the two who had gone, retry alone
and commit) or commit an attempt whose reports were all in — each a second φ for a round the
others had completed without it. A join sent while we were stopped is read on waking and looks
fresh, though its sender may have hung up since.

The design. A pulse every `PULSE_S` (crdt/swarm_records.py `LoopPauses`), noted again first thing
on every path of the coordinator that decides (a join, a report, a timer), tells a pause of ours
(`note`). The coordinator (coordinator.py `note_running`) then restarts a round still collecting
joins with one from before the pause — its joiners are told to join anew (`Late(regroup=True)`;
those still waiting come back within a round trip, and one that left no longer counts) — and
holds every attempt under way: no report or deadline decides it while its other members are asked
where they are (`gone_members`). If every one says it is still in the round here, the attempt goes
on; if one went on without us, is past the round or does not answer, it is aborted, and its
members that stayed withhold their φ and re-sync, as after any failed round. A member that gave up
on us mid-attempt also said so (a leave report, sent before it joins elsewhere), read when we
resume. So a pause too short for anyone to leave (a member takes us for silent after two missed
heartbeats and a probe, ~5 s at least; a loop blocked a few seconds by a large model's work) costs
a probe of up to `PROBE_EVERY`, not the round and every member's re-sync. For `WOKEN_S` after a
pause a join is checked with its joiner first (`join_stands`): one that says it is in the round at
another coordinator, or past it, has hung up, and so has one that refuses to answer because it no
longer counts us a member (our lease ran out in its view while we were stopped: it gave up on us);
one not in the round yet (a join prepared ahead of it: prepared.py), or no answer, keeps its join.

Wire: only the WHERE probe (probe.py). Failures: a member's answer lost or late counts as gone
(the attempt is aborted, as before this hold existed); a joiner's lost answer keeps its join.
Not here: the round state the coordinator restarts or holds (coordinator.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import trio

from meshtrain.collective.probe import Refused, ask_where, probe_where
from meshtrain.collective.protocol import NOT_A_MEMBER, RoundKey, WhereReply
from meshtrain.crdt.swarm_records import LoopPauses
from meshtrain.log import get_logger, kv
from meshtrain.transport.host import Host

log = get_logger(__name__)

WOKEN_S = 3.0  # joins read this soon after a pause of ours are checked with their joiners


class OwnPauses:
    """The pauses of our loop as a coordinator, and the questions we ask our peers after one."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.loop = LoopPauses()
        self.woke_at: float | None = None  # when the last pause of ours ended

    def note(self, now: float) -> float:
        """Our loop runs at `now`: the seconds of a pause of ours that ended since the last note
        (0: none)."""
        pause = self.loop.note(now)
        if pause:
            self.woke_at = now
        return pause

    async def join_stands(self, peer: str, key: RoundKey) -> bool:
        """Whether `peer`'s join of `key` still stands: always, but in the first `WOKEN_S` after a
        pause of ours, when it may have been sent while we were stopped and read only now by a
        joiner that took us for silent since (a 3-daemon run: it completed the round at the next
        candidate, and ours, formed with its join, became a round of one)."""
        me = self.host.peer_id
        if self.woke_at is None or peer == me or trio.current_time() - self.woke_at > WOKEN_S:
            return True
        where = await probe_where(self.host, peer, key.tag, key.round_id)
        if isinstance(where, Refused) and where.code == NOT_A_MEMBER:
            # It no longer counts us a member — our lease ran out in its view while we were
            # stopped — so it gave up on us as its coordinator: a 30-minute soak's coordinator
            # kept such a join, fixed a group with it, and waited 22 s for the joiner's data.
            log.info(kv("allreduce join read after our pause is stale", key=key, peer=peer[-8:], where="not a member"))
            return False
        if not isinstance(where, WhereReply):
            return True
        past = where.finished >= key.round_id or where.round_id > key.round_id
        elsewhere = where.round_id == key.round_id and where.coordinator not in (None, me)
        if not past and not elsewhere:
            return True
        log.info(kv("allreduce join read after our pause is stale", key=key, peer=peer[-8:], where=where))
        return False

    async def gone_members(self, key: RoundKey, group: Sequence[str]) -> list[str]:
        """The members of an attempt of `key` among `group` (us aside) that do not say they are
        still in the round here — elsewhere, past it, or no answer in `PROBE_EVERY` — sorted."""
        me = self.host.peer_id
        others = [p for p in group if p != me]
        answers: dict[str, WhereReply] = {}

        async def ask(peer: str) -> None:
            if (where := await ask_where(self.host, peer, key.tag, key.round_id)) is not None:
                answers[peer] = where

        async with trio.open_nursery() as nursery:
            for p in others:
                nursery.start_soon(ask, p)
        return sorted(p for p in others if p not in answers or not stayed(answers[p], key, me))


def stayed(where: WhereReply, key: RoundKey, coordinator: str) -> bool:
    """Whether a member that says it is at `where` is still in round `key` at `coordinator`."""
    return (
        where.round_id == key.round_id
        and where.coordinator == coordinator
        and where.tag in (None, key.tag)
        and where.finished < key.round_id
    )
