"""Asking a peer where it is in a round's series (`WHERE_RPC`), and telling a silent peer apart.

Problem. A round waits for peers: a coordinator for the missing candidates' joins, a member for
the other members' data. A SIGSTOPped peer (a laptop lid closed, a VM paused, a process stopped
in a debugger) or one behind a cut cable keeps its connections open — nothing closes them — and
its membership live until its lease runs out (12 s). A coordinator waited for it that long, and
a data phase holding it (its join sent ahead, collective/prepared.py) waited out the transfer
deadline, 20 s and more: at sub-second rounds, the longest stretches without a round in a
30-minute chaos soak (docs/benchmarks.md, "Chaos soak"). A slow peer must still be waited for:
its step may take longer, its link may be saturated.

Design. Two signals, both needed, from two planes:
- **The probe**: `WHERE_RPC` (the coordinator already asks missing peers where they are,
  missing_peers.py) with a `PROBE_EVERY` deadline. A live peer answers from its event loop at once,
  whatever its trainer does; a stopped one says nothing (`probe_where` → True: the RPC timed out,
  told apart from a refusal or an unreachable peer, False).
- **Its heartbeats** (`quiet(peer)`, the node's `PeerPresence.heartbeats_stopped`): no
  membership record from it for two heartbeat intervals (+1 s) by our monotonic clock. A live
  peer on a saturated uplink may answer a probe late — a home link's buffers hold seconds of
  data — but its small heartbeats still arrive.
A peer that leaves a probe unanswered for `PROBE_EVERY` while its heartbeats have stopped is
*silent* (`SilentPeers`): for `SILENT_KEEP_S`, or until it is heard from (it joins a round, or
answers a probe). Without `quiet` (a collective used without a node's presence) the probe alone
decides. The probe need not have gone out after the heartbeats stopped: one out `PROBE_EVERY`
unanswered looks at the peer's heartbeats every `WATCH_EVERY` from then on (`ask_patiently`),
so the peer is silent as soon as they are found stopped — 4–7 s after a stop at 3 s beats.
Until stop 66 a probe only counted if it was sent to a peer already quiet and timed out after
that, up to 4 s later: a 10-minute soak's data phase took its member, stopped as the round
began, for silent 9.4 s after the stop.

Sparse heartbeats. Heartbeats come every 3 s only in a swarm of up to 12 peers: the interval
stretches with the swarm so that gossip stays O(log N) per peer (crdt/heartbeat_rate.py), to
10.7 s at 64 peers and 32 s at 256, and "two intervals + 1 s" with it, to 22 s and 65 s. A
stopped peer's last heartbeat then stays recent for longer than the deadlines it should cut
short: in a large swarm a stopped partner held its group's round to the join deadline (30 s)
or the part deadline (20 s) every time — silence was detected where it mattered least. So every
probe is *patient*: it is given `QUIET_S` (7 s, the heartbeat rule's own window at 3 s beats),
and left unanswered that long, the peer is silent whatever its heartbeats. A live peer on a
saturated link answers within it, as its heartbeats would arrive within it; one whose loop is
alive answers at once. One probe per watched peer at a time, the next `PROBE_EVERY` after an
answer — no background traffic, nothing that grows with the swarm. Where heartbeats are
frequent the heartbeat rule decides first (4–7 s after a stop; the patient probe, sent
`PROBE_AFTER` into a wait, 9 s in), so a small swarm's only change is a peer deaf over our
connection while its heartbeats arrive (below), silent after `QUIET_S` rather than at the
deadline.

What each side does with it. The coordinator fixes a round's group without missing peers that are
all silent (or past the round), provided two or more joined and they are a majority of the peers
not silent (missing_peers.py `without_silent`), and later rounds do so as soon as everyone else
is in; a lone joiner keeps waiting, since a round of one beside a stopped partner is a solo round
(node/state/parity.py); it acts the moment a probe finds a peer silent (`SilentPeers.ask_all`),
not at the end of the probe pass under way. A member in a data phase asks the peers it depends on,
from `PROBE_AFTER` on (`wait_silent`), and fails the attempt with the silent ones as suspects (data_phase.py `_watch_silence`, from the attempt's start: connecting to
a stopped peer hangs too): the coordinator retries without them at once, as for a dropped
connection. A joiner's state download drops a silent donor alike (node/state/fetch.py,
"Silence"; the probe's answer is not read there, only whether one comes). A member probes its round's coordinator alike, at
any step of the round (waiting for the group, in the data phase, waiting for the outcome: each is
an RPC to it that would hang until its deadline) and, finding it silent, restarts the round at
the next candidate, naming the silent one as skipped (member_round.py `MemberRounds._run_round`,
`CoordinatorLost`), where the others go too. A verdict is the whole process's: a member that
finds a peer silent (its watch on its coordinator, its data phase) marks it for the rounds its
own coordinator keeps (`SilentPeers.mark`) — the next candidate is a member of the round too, and
probed the silent one afresh, 4 s more, before it fixed the group without it (a stop-66 soak) —
and a data phase that finds the round's coordinator itself silent leaves for the next candidate
at once, rather than report its failure to it and wait for its watch.

Failures. Silence is judged by our own loop: a probe whose deadline fired more than `LATE_S`
late proves nothing (our loop was starved, and the answer may be unread: `probe_where`), and it is
probed again. (The likeliest reading of a loaded test run's failure: three in-process peers, one
starved loop between them, took their coordinator for silent, and the member that left made its
partner's round one of one.) A host whose own loop is late at every probe thus takes nobody for
silent: stopped peers are then dropped when their leases run out, as before these rules. A peer
taken for silent that was only slow (its loop stalled for seconds while its heartbeats lagged
too) is late for the round: it proceeds alone, withholds its φ and re-syncs, as any late peer —
a download, at worst. A partition makes each side's peers silent to the other:
each side with two or more goes on among itself, as it would once the leases ran out, and the
parity rule picks one lineage when it heals.

Stalled connections. The converse — a probe unanswered while the peer's heartbeats arrive —
is a peer alive but deaf over *our* connection: after a partition heals, a connection it cut
stays stalled for many seconds more (TCP's retransmission timer backed off while the path was
dead; no reset ever came), while the peer's heartbeats reach us through others' gossip. A 10-minute
soak's re-sync waited 25 s so for its one donor's manifest. `wait_stalled` finds such peers; a
state download closes the connection and asks again over a fresh one, once per donor
(node/state/fetch.py, "Silence"). A peer whose loop is starved (a hash in its event loop's
thread) reads alike; for it the cost is a redial. The collective does not redial (a round's data
moves on the data plane's own connections): a member deaf for `QUIET_S` is silent (above).

Wire: `WHERE_RPC` as it is (protocol.py); nothing new.
How a coordinator reads its missing peers' answers is `Whereabouts`: in this round under another
group's tag (regroup), past it, in it at a lower-id coordinator (hand over), left behind (further
behind than the round window, or behind and not training: it must re-sync before it can join),
or fetching the swarm's state (no round in this life, not training: not coming soon).
Not here: the WHERE answer (own_rounds.py), what a coordinator does with the answers
(missing_peers.py `MissingPeers.probe`), membership leases (crdt/swarm_view.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import trio

from meshtrain.collective.protocol import PROBE_AFTER, PROBE_EVERY, WHERE_RPC, RoundKey, WhereReply, WhereRequest
from meshtrain.transport.host import Host
from meshtrain.transport.rpc import RemoteError, RpcError, RpcTimeout
from meshtrain.transport.validate import Malformed

# A peer whose heartbeats still arrive but that leaves one probe unanswered this long is silent
# all the same: the heartbeat rule's own window where heartbeats come every 3 s (two of them + 1 s),
# which it keeps wherever the swarm's heartbeats are sparser (module docstring, "Sparse heartbeats").
QUIET_S = 7.0
SILENT_KEEP_S = 20.0  # a silent peer is taken for silent this long, unless heard from first
WATCH_EVERY = 0.25  # how often a patient probe looks at its peer's heartbeats, once PROBE_EVERY old
# A probe's deadline that fired this much late was ours: our loop was starved (a loaded machine;
# in-process peers share one loop), and the peer's answer may be unread. Such a probe proves nothing.
LATE_S = 0.5


async def ask_where(host: Host, peer: str, tag: str, round_id: int) -> WhereReply | None:
    """`peer`'s answer to WHERE about round `round_id` of series `tag` (the round it is in, the
    last it ended), or None when it gives none in `PROBE_EVERY` (or none we can read)."""
    where = await probe_where(host, peer, tag, round_id)
    return where if isinstance(where, WhereReply) else None


@dataclass(frozen=True)
class Refused:
    """A peer's refusal to say where it is: its error code (`NOT_A_MEMBER`: it does not count us
    a member of the round, so it is not waiting on us either — our lease ran out in its view)."""

    code: str


async def probe_where(
    host: Host, peer: str, tag: str, round_id: int, *, timeout: float = PROBE_EVERY
) -> WhereReply | Refused | bool:
    """As `ask_where`, telling apart the peer that said nothing in `timeout` (True: it may be
    silent) from one that refused to answer (`Refused`) and one whose answer failed otherwise
    (False: unreachable, garbled), or whose silence proves nothing: our own event loop ran
    `LATE_S` past the probe's deadline, so an answer may be lying unread in our socket (False)."""
    sent = trio.current_time()
    try:
        reply = await host.rpc.call(peer, WHERE_RPC, WhereRequest(tag, round_id).to_wire(), timeout=timeout)
        return WhereReply.parse(reply)
    except RpcTimeout:
        return trio.current_time() - sent - timeout <= LATE_S
    except RemoteError as e:
        return Refused(e.code)
    except (RpcError, Malformed):
        return False


async def ask_patiently(
    host: Host, peer: str, tag: str, round_id: int, quiet: Callable[[str], bool] | None
) -> WhereReply | Refused | bool:
    """One patient probe of `peer` (module docstring): True — silent — once the probe is
    `PROBE_EVERY` old unanswered while its heartbeats have stopped (`quiet`, looked at every
    `WATCH_EVERY` from then on, at once when they stop; None: not known, the probe alone decides
    at `PROBE_EVERY`), or unanswered after `QUIET_S` whatever its heartbeats; else
    `probe_where`'s reading of its answer. A look our loop took `LATE_S` late proves nothing (an
    answer may lie unread): the next one decides."""
    verdict: WhereReply | Refused | bool | None = None

    def decide(found: WhereReply | Refused | bool) -> None:
        nonlocal verdict
        if verdict is None:  # the first reading stands: the other task may already be awake
            verdict = found
        nursery.cancel_scope.cancel()

    async def ask() -> None:
        decide(await probe_where(host, peer, tag, round_id, timeout=QUIET_S))

    async def watch() -> None:
        due = trio.current_time() + PROBE_EVERY
        while True:
            await trio.sleep_until(due)
            if trio.current_time() - due <= LATE_S and (quiet is None or quiet(peer)):
                decide(True)
                return
            due = trio.current_time() + WATCH_EVERY

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask)
        nursery.start_soon(watch)
    assert verdict is not None
    return verdict


async def wait_silent(
    host: Host, peers: Callable[[], Iterable[str]], quiet: Callable[[str], bool], key: RoundKey | None = None
) -> set[str]:
    """From `PROBE_AFTER` on, watch `peers()` and return the ones that went silent (module
    docstring): each is asked patiently (`ask_patiently`), one probe at a time, the next
    `PROBE_EVERY` after an answer; silent once a probe finds it so — `PROBE_EVERY` unanswered
    with its heartbeats stopped, or `QUIET_S` unanswered. A peer that leaves `peers()` is no
    longer asked. Used by a data phase's watch (data_phase.py), a member's watch on its
    coordinator (allreduce.py) and a state download's (node/state/fetch.py). `key`: the round
    the probe asks about (None: none — the answer does not matter then, only whether one comes).
    A wait shorter than `PROBE_AFTER` probes nobody."""
    tag, round_id = (key.tag, key.round_id) if key is not None else ("", -1)
    silent: set[str] = set()
    found = trio.Event()
    asking: set[str] = set()  # peers with a probe in flight or due

    async def watch(peer: str) -> None:
        try:
            while peer in set(peers()):
                if await ask_patiently(host, peer, tag, round_id, quiet) is True:
                    if peer in set(peers()):
                        silent.add(peer)
                        found.set()
                    return
                await trio.sleep(PROBE_EVERY)
        finally:
            asking.discard(peer)

    await trio.sleep(PROBE_AFTER)
    async with trio.open_nursery() as nursery:
        while not silent:
            for p in peers():
                if p not in asking:
                    asking.add(p)
                    nursery.start_soon(watch, p)
            with trio.move_on_after(PROBE_EVERY):  # then look at `peers()` again
                await found.wait()
        nursery.cancel_scope.cancel()
    return silent


async def wait_stalled(host: Host, peers: Callable[[], Iterable[str]], quiet: Callable[[str], bool]) -> set[str]:
    """The other reading of an unanswered probe: from `PROBE_AFTER` on, every `PROBE_EVERY`,
    probe those of `peers()` whose heartbeats still arrive (not `quiet`); return the ones that
    said nothing. Alive, by its heartbeats, yet deaf over our connection: the connection may be
    stalled (module docstring, "Stalled connections"); a fresh one may well pass."""
    deaf: set[str] = set()

    async def probe(peer: str) -> None:
        if await probe_where(host, peer, "", -1) is True and not quiet(peer):
            deaf.add(peer)

    await trio.sleep(PROBE_AFTER)
    while True:
        async with trio.open_nursery() as nursery:  # one pass: each heartbeating peer at once
            for p in peers():
                if not quiet(p):
                    nursery.start_soon(probe, p)
        if deaf:
            return deaf
        await trio.sleep(PROBE_EVERY)


class SilentPeers:
    """The peers taken for silent (module docstring). `quiet(peer)`: whether its heartbeats
    stopped reaching us (None: not known, the probe alone decides). `start_soon`: where the
    patient probes run (None: none — the coordinator's own probe decides, and a peer whose
    heartbeats still arrive is never taken for silent: how it was before them). Time is trio's
    clock."""

    def __init__(
        self, quiet: Callable[[str], bool] | None = None, start_soon: Callable[..., None] | None = None
    ) -> None:
        self.quiet = quiet
        self.start_soon = start_soon
        self.marks: dict[str, float] = {}  # peer -> when it was last found silent
        self.patient: set[str] = set()  # peers with a patient probe in flight
        self._marked = trio.Event()  # set (and replaced) when a peer is marked

    async def probe(self, host: Host, peer: str, tag: str, round_id: int) -> WhereReply | None:
        """Ask `peer` where it is, within `PROBE_EVERY` (the coordinator reads the answer); forget
        its mark if it answers. Whether it is silent, a patient probe decides (`ask_patiently`,
        in the background, from this first probe on, one at a time per peer); without
        `start_soon`, this probe: unanswered while its heartbeats stopped, it is marked."""
        if self.start_soon is not None and peer not in self.patient:
            self.patient.add(peer)
            self.start_soon(self._probe_patiently, host, peer, tag, round_id)
        where = await probe_where(host, peer, tag, round_id)
        if isinstance(where, WhereReply):
            self.heard(peer)
            return where
        if where is True and self.start_soon is None and (self.quiet is None or self.quiet(peer)):
            self.marks[peer] = trio.current_time()
        return None

    async def _probe_patiently(self, host: Host, peer: str, tag: str, round_id: int) -> None:
        try:
            where = await ask_patiently(host, peer, tag, round_id, self.quiet)
            if where is True:
                self.mark([peer])
            elif isinstance(where, WhereReply):
                self.heard(peer)
        finally:
            self.patient.discard(peer)

    async def ask_all(self, host: Host, peers: Iterable[str], tag: str, round_id: int) -> dict[str, WhereReply]:
        """Ask each of `peers` where it is (`probe`), all at once; their answers — as many as came
        before a patient probe marked a peer, if one did: the coordinator acts on that at once,
        not at the end of this pass (the next pass asks again)."""
        answers: dict[str, WhereReply] = {}

        async def ask(peer: str) -> None:
            if (where := await self.probe(host, peer, tag, round_id)) is not None:
                answers[peer] = where

        async def cut_short(scope: trio.CancelScope) -> None:
            await self._marked.wait()
            scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(cut_short, nursery.cancel_scope)
            async with trio.open_nursery() as asks:
                for p in peers:
                    asks.start_soon(ask, p)
            nursery.cancel_scope.cancel()
        return answers

    def mark(self, peers: Iterable[str]) -> None:
        """`peers` were found silent by the same rule elsewhere in this process (a member's watch
        on its coordinator, a data phase's): take them for silent here too, at once."""
        at = trio.current_time()
        for p in peers:
            self.marks[p] = at
        self._marked.set()  # wakes `ask_all`
        self._marked = trio.Event()

    def heard(self, peer: str) -> None:
        """`peer` spoke (a join, an answer): it is not silent."""
        self.marks.pop(peer, None)

    def now(self) -> set[str]:
        """The peers silent now: marks older than `SILENT_KEEP_S` lapse."""
        at = trio.current_time()
        for p in [p for p, t in self.marks.items() if at - t > SILENT_KEEP_S]:
            del self.marks[p]
        return set(self.marks)


@dataclass
class Whereabouts:
    """What a round's missing peers answered a coordinator's probe, peer by peer."""

    regrouped: dict[str, str] = field(default_factory=dict)  # in this round under another tag (that tag)
    passed: set[str] = field(default_factory=set)  # past this round
    elsewhere: dict[str, str] = field(default_factory=dict)  # in it at a lower-id coordinator (that one)
    behind: set[str] = field(default_factory=set)  # left behind: it re-syncs before it can join
    fetching: set[str] = field(default_factory=set)  # fetching the swarm's state: not coming soon

    @classmethod
    def of(
        cls,
        answers: Mapping[str, WhereReply],
        key: RoundKey,
        me: str,
        window: int | None,
        *,
        trains: Callable[[str], bool] | None = None,
        rounds_ended: bool = False,
        waited: bool = False,
    ) -> Whereabouts:
        """Read `answers` for round `key` coordinated by `me`; `window`: our round window (None:
        none); `trains(peer)`: whether a peer trains now (a fresh progress record; None: not
        known); `rounds_ended`: whether rounds of this series ended here before; `waited`:
        whether the round has waited its short wait for a peer that is not coming soon
        (missing_peers.py `OWN_TRAINER_WAIT`).

        Left behind (`behind`): a peer further behind than the round window (stopped while the
        swarm went on: allreduce.py refuses its joins as out of our window), or behind this round
        and not training — it is fetching a state, which may be ours, offered only once this
        round ends (a loaded test run's front peer, refused by the group it had left behind,
        coordinated its round and waited the hard join deadline, 90 s, for the group's peer 35
        rounds behind, which re-synced in a loop, finding no donor, while it waited).

        `fetching`: a peer that has had no round in this life (it answers from none, -1) and does
        not train, where rounds ended here before — a restart or joiner fetching the swarm's
        state (at a swarm's start such a peer is starting, and is waited for) — once the round
        `waited`. A 30-minute soak's round waited 12 s for a restart whose download hung on a
        stopped donor, and a joiner fetching a multi-GB state would hold every round the join
        deadline (30 s) for minutes. A download done within the wait makes the round; a later
        one finds the group fixed, and re-syncs to the round's state."""
        found = cls()
        for p, a in answers.items():
            at = max(a.round_id, a.finished)
            if a.round_id == key.round_id and a.tag is not None and a.tag != key.tag:
                found.regrouped[p] = a.tag
            elif a.finished >= key.round_id or a.round_id > key.round_id:
                found.passed.add(p)
            elif a.round_id == key.round_id and a.coordinator is not None and a.coordinator < me:
                found.elsewhere[p] = a.coordinator
            elif window is not None and 0 <= at < key.round_id - window:
                found.behind.add(p)
            elif trains is not None and not trains(p):
                if 0 <= at < key.round_id:
                    found.behind.add(p)
                elif at < 0 and rounds_ended and waited:
                    found.fetching.add(p)
        return found
