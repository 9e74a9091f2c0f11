"""Joins sent before a round's data is ready: `PreparedJoins`.

Problem. A round's first step is the join: one RPC round trip to the coordinator, then a wait
until every expected peer has joined. The join needs nothing from the round's data (its key, our
uplink, our stripe taper), yet it sits on the critical path. Over a 20 ms one-way WAN link it is
a third of a small Streaming DiLoCo fragment round (join, data, report), and it is the part that
training could not hide at τ = 9 inner steps of 13 ms (scripts/bench/bench_wan.py,
`streaming_overlap_ratio`).

Design. The outer optimizer knows when its next exchange is due. A little ahead of it (about a
second: outer_round.py, `PREPARE_LEAD_S`) it calls the collective's `prepare(round_id, tag,
within)` (contract.py `PreparesRounds`). Unless we coordinate the round, the collective then
sends the round's first join at once, in the background, exactly as `all_reduce` would send it:
the same key (the lowest candidate of our current view as coordinator), nothing skipped. The
pending reply is kept here. When `all_reduce` comes for that round, and its first join has the
same key, it takes the prepared reply instead of joining again, waiting for it if it has not
come yet. Whatever the reply is (`Joined`, `Moved`, `Late`, or an error: the coordinator is gone
or refused us), the round loop handles it exactly as if the join had just been sent. When the
optimizer knows the round will not run (its training ended: `finish`), it says so
(`unprepare`), and the join is dropped.

The coordinator does not prepare. Its own join is a local call, so there is no round trip to
save. And the group is fixed only once every expected peer has joined, the coordinator included,
so the group still forms when the coordinator reaches the round's data, as without preparing: a
newcomer that enters the membership meanwhile is still expected and waited for. (When the
coordinator prepared too, a soak of real daemons saw the creator, training alone, fix a group of
one a round ahead; the three joiners that arrived meanwhile were told they were late and
re-synced at once.) So the others' joins wait at the coordinator, and each saves the way there:
the round starts for them one trip after the coordinator's data is ready instead of a round trip
after their own. The barrier does not move: a peer whose data is ready still waits at the join
for the coordinator, and in the data phase for slower peers, as before.

Failures. `all_reduce` may never take a prepared join: the trainer re-synced to another step,
the optimizer stopped, or the round began at another coordinator. The join would then keep us
in a group that waits for our data until its part deadline. So an entry expires
`2·within + EXPIRY_SLACK` seconds after it was prepared — unless our trainer is still on its way
to the round (`coming`: its step is not past the round's, OwnRounds in own_rounds.py), only
slower than it expected; then the entry lives on, `EXPIRY_SLACK` at a time — and an
`all_reduce` that starts the round under another key drops it. (A trainer slowed past the expiry,
on a loaded machine, had its join withdrawn just as the group formed: its one partner was left
a round of one, and both spent the round alone — tests/test_prepared_rounds.py. A trainer that
slow now holds its group as a slow peer's data does, until the data phase's deadline.) In both
cases, if the coordinator had admitted us (`Joined`), we withdraw: the self-accusing FAIL report
that a peer leaving mid-round sends. The others then retry without us at once. (A dropped join
whose group is not fixed yet is withdrawn when its reply comes.) A peer that exits altogether is
seen to disconnect.

Not here: when to prepare (outer_round.py); the join RPC and the withdrawal report
(coordinator_client.py); the round loop (member_round.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from meshtrain.collective.protocol import Joined, JoinReply, JoinRequest, RoundKey
from meshtrain.log import get_logger, kv

log = get_logger(__name__)

EXPIRY_SLACK = 5.0  # seconds a prepared join outlives twice its expected wait
MAX_PREPARED = 16  # entries kept; the oldest is dropped (and withdrawn) past this


@dataclass
class PreparedJoin:
    """One join sent ahead of its round, and what came back."""

    join: JoinRequest
    expires: float  # trio time
    done: trio.Event = field(default_factory=trio.Event)  # the reply (or error) is in
    claimed: trio.Event = field(default_factory=trio.Event)  # all_reduce took it, or dropped it
    used: bool = False  # all_reduce took the reply (else it is withdrawn once in)
    reply: JoinReply | None = None
    error: Exception | None = None


class PreparedJoins:
    """The joins this peer sent ahead of their rounds, by (round id, tag).

    send_join: sends one join and returns the coordinator's reply (raises as the round loop
        expects). withdraw: the leaving report for (key, attempt), quiet on failure. coming:
        whether our trainer is still on its way to the key's round (keeps an entry past expiry).
    `slack`: seconds an entry outlives twice its expected wait (`EXPIRY_SLACK`).
    """

    def __init__(
        self,
        send_join: Callable[[JoinRequest], Awaitable[JoinReply]],
        withdraw: Callable[[RoundKey, int], Awaitable[None]],
        coming: Callable[[RoundKey], bool] = lambda key: False,
    ) -> None:
        self._send_join = send_join
        self._withdraw = withdraw
        self._coming = coming
        self._entries: dict[tuple[int, str], PreparedJoin] = {}
        self.slack = EXPIRY_SLACK
        self.prepared = 0  # counters, for tests and logs
        self.used = 0
        self.withdrawn = 0

    def __contains__(self, round_and_tag: tuple[int, str]) -> bool:
        return round_and_tag in self._entries

    def prepare(self, join: JoinRequest, within: float, nursery: trio.Nursery) -> None:
        """Send `join` now in `nursery`; its round is expected in about `within` seconds."""
        slot = (join.key.round_id, join.key.tag)
        if slot in self._entries:
            return
        entry = PreparedJoin(join, trio.current_time() + 2 * max(within, 0.0) + self.slack)
        self._entries[slot] = entry
        self.prepared += 1
        while len(self._entries) > MAX_PREPARED:
            oldest = next(iter(self._entries))
            self._entries.pop(oldest).claimed.set()  # not used: withdrawn once its reply is in
        log.debug(kv("allreduce join prepared", key=join.key, within=f"{within:.3f}"))
        nursery.start_soon(self._hold, entry)

    def drop(self, round_id: int, tag: str) -> None:
        """The round will not run: withdraw its prepared join (once its reply is in)."""
        self._claim(round_id, tag)

    def _claim(self, round_id: int, tag: str) -> PreparedJoin | None:
        """Take the entry of (round_id, tag) out, waking its holder; None if there is none."""
        entry = self._entries.pop((round_id, tag), None)
        if entry is not None:
            entry.claimed.set()
        return entry

    async def take(self, join: JoinRequest) -> JoinReply | None:
        """The prepared reply for `join` (a round's first join), or None: no join was prepared
        for its round, or one was under another key (then it is dropped and withdrawn)."""
        entry = self._claim(join.key.round_id, join.key.tag)
        if entry is None or entry.join.key != join.key or join.skipped:
            return None
        entry.used = True
        self.used += 1
        await entry.done.wait()
        if entry.error is not None:
            raise entry.error
        return entry.reply

    async def _hold(self, entry: PreparedJoin) -> None:
        try:
            entry.reply = await self._send_join(entry.join)
        except Exception as e:  # handed to the round that takes it, as if it had just joined
            entry.error = e
        finally:
            entry.done.set()
        while True:
            with trio.move_on_at(entry.expires):
                await entry.claimed.wait()
            if entry.claimed.is_set() or not self._coming(entry.join.key):
                break
            entry.expires = trio.current_time() + self.slack  # our trainer is slow, not gone
            log.debug(kv("allreduce prepared join kept: our trainer is still coming", key=entry.join.key))
        if entry.used:
            return
        key = entry.join.key
        if self._entries.get((key.round_id, key.tag)) is entry:
            del self._entries[(key.round_id, key.tag)]
        if isinstance(entry.reply, Joined):
            self.withdrawn += 1
            log.info(kv("allreduce prepared join not used; withdrawing", key=key))
            await self._withdraw(key, entry.reply.attempt)
