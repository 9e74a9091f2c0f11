"""Fault-tolerant all-reduce among a swarm's peers: `SwarmCollective`.

The problem: average a dict of tensors among peers that may be SIGKILLed, stall or lie at any
moment, with every survivor ending on bit-identical results, and no survivor waiting much longer
than one deadline after a failure.

**Group and attempts.** A round's candidate group comes from the membership snapshot
(`membership(round_id)`; in grouped rounds, within our group of the round's roster, groups.py). Its *coordinator* is the lowest peer id among them that answers — no
fixed leader: if it dies, peers fall back to the next lowest id and start over there. The
coordinator collects joins (until all candidates joined, or `join_timeout`), fixes the group of
attempt 0, and later decides each attempt's outcome. A peer that joins after the group was fixed
is told it is late and waits for the next round (`CollectiveError`). Membership is eventually
consistent, so a peer that has not yet heard of a newcomer with a lower id may think it is the
coordinator while the others follow the newcomer: while collecting joins, a coordinator re-reads
the membership and, once a lower-id candidate it is connected to appears, hands the round over —
everyone who joined it is told to start again there (`Moved`) — instead of waiting out
its join deadline alone. Likewise a peer that entered a round late (a joiner whose downloaded state
was one round old) may wait as coordinator for peers that already finished that round: once every
missing peer has joined a later round of the same series here, nobody else will come — a majority
that joined completes the round at once; a minority (the stale peer alone) is told the round has
passed (`CollectiveError`; the node then re-syncs) instead of waiting out the deadline.
A coordinator still missing peers after `PROBE_AFTER` asks them where they are (`WHERE_RPC`): a
dropped connection can hide the lowest id from its membership while the others still follow it,
and without asking it would wait out the hard join deadline alone. Peers already past the round
count as passed; peers in it at a lower-id coordinator make it hand over there, or, if that
coordinator cannot be reached, end the round at once (`CollectiveError`); peers in it under
another group's tag (their view of the roster differed from ours when they entered it) make it
tell its joiners to regroup: each computes its group anew and joins again (coordinator.py,
"Groups that disagree"). hivemind forms groups through
DHT matchmaking and PCCL through a master; a per-round, replaceable coordinator gives PCCL's
clean attempt semantics without a node the swarm cannot lose. A join may be sent ahead of its
round's data (`prepare`, prepared.py), saving the round a join round trip. SparseLoCo's payloads
travel whole, not reduced: `all_gather` (sparse_gather.py) sends them over the same data plane and
agrees on whose count through one small all-reduce.

**Data phase** (one attempt, group of n, flattened input of M elements cut into n parts; part j
belongs to the j-th peer): reduce-scatter — every peer sends part j (optionally codec-encoded,
with its weight) to its owner, which accumulates contributions in fp32 as they arrive; then
all-gather — each owner encodes its reduced part once, decodes it back for itself, and sends the
same bytes to all. Every peer thus holds the owner's exact bits for every part, so results are
bit-identical by construction; a blake3 digest of the result, reported to the coordinator,
checks it. Each peer moves 2(n−1)/n·M elements, the bandwidth-optimal amount (as hivemind's
butterfly and PCCL's ring); all transfers of a phase run concurrently over `TensorStreams`.
Where link speeds differ, parts are weighted: every join carries the peer's uplink (`uplink_mbit`
configured, else measured on its sends in an earlier round), the coordinator sizes the parts
from the members' rates and announces the shares with the group, so all members cut alike and a
slow peer owns little or nothing (shares.py, as hivemind's load balancing sizes its parts).

**Failures.** Every transfer has a deadline scaled to its size, and peers we are waiting on are
watched for disconnection (the host's connection events) and for silence (heartbeats stopped, a
probe unanswered: probe.py), so a killed peer is noticed within a second, a stopped one within
seconds, and a merely slow one at the deadline. A failure reported to the coordinator makes it
declare the next attempt without the suspects at once; members whose digest is in the minority
re-sync from a holder of the committed one; members whose coordinator dies, goes silent or leaves
the round's candidates restart the round at the next lowest id; a peer that is itself cut off
raises `CollectiveError` (a member's side of each: member_round.py, "Attempts", "The commit",
"Coordinator lost").

**Robust aggregation** (`robust="trimmed_mean"` or `"clipped_mean"`, aggregation.py): owners
combine their part's contributions coordinate-wise, dropping the extremes or clipping norms; a
contribution with NaN/inf or of the wrong size is rejected and its sender named in
`ReduceResult.excluded`. With `screen_norm`, every committed round's `RoundScreening` (flags;
with `score_samples`, the sampled peers' contributions for loss scoring; with `screen_echo`,
replays dropped: echoes.py) is in `ReduceResult.screening` and goes to `screening_listeners`.

**Where the parts live.** This file is the participant's service: `SwarmCollective`, its RPC
handlers (every request passes round_gate.py first: a member of the round, for a round near ours,
or a typed refusal), our group of a round and its tag, joins sent ahead (`prepare`), and
`all_reduce`'s entry, which computes our group anew when the round's peers grouped it differently
(at most `MAX_REGROUPS` times). A member's side of one round — joining, hand-overs and restarts at
the next coordinator, each attempt, the commit — is member_round.py (`MemberRounds`). The
coordinator's state machine is coordinator.py, one attempt's reduce-scatter and all-gather is
data_phase.py (`AttemptPlan`, planned from the coordinator's layout before bytes move; `DataPhase`,
which moves them), our input — flattened and checked for finiteness once per round, in a worker
thread while the join goes out — is contribution.py, the member's control RPCs to the coordinator
are coordinator_client.py (waiting for a join's reply, join_wait.py), joins sent ahead are
prepared.py, the committed result's transfer to members without it is committed.py, and every
control message, with its wire form, limits and `parse`, is protocol.py. The public names
(`SwarmCollective`, `AllReduceConfig`, the RPC names and refusal codes) are importable from here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from typing import Any

import torch
import trio

from meshtrain.collective.contract import CollectiveError, GatherResult, ReduceResult, RoundRequest, RoundScreening
from meshtrain.collective.contribution import Contribution
from meshtrain.collective.coordinator import Coordinator
from meshtrain.collective.coordinator_client import CoordinatorClient
from meshtrain.collective.echoes import EchoMemory
from meshtrain.collective.flat import STRIPE_TAPER
from meshtrain.collective.groups import GroupPlan, RoundGroups
from meshtrain.collective.member_round import MemberRounds, Regroup
from meshtrain.collective.own_rounds import OwnRounds
from meshtrain.collective.pairwise import average_pair
from meshtrain.collective.prepared import PreparedJoins
from meshtrain.collective.probe import ask_where
from meshtrain.collective.protocol import (
    COORDINATOR_BEHIND,
    JOIN_RPC,
    NOT_A_MEMBER,
    OUT_OF_WINDOW,
    REPORT_RPC,
    WATCH_RPC,
    WHERE_RPC,
    WITHDRAW_RPC,
    AllReduceConfig,
    JoinRequest,
    Report,
    WatchRequest,
    WhereReply,
    WhereRequest,
    Withdrawal,
)
from meshtrain.collective.round_gate import RoundGate
from meshtrain.collective.sparse_gather import gather_over_streams
from meshtrain.lifecycle import Service
from meshtrain.log import get_logger, kv
from meshtrain.transport.host import Host
from meshtrain.transport.tensor_streams import TensorStreams

log = get_logger(__name__)

# A round whose peers keep grouping it differently (their views of its roster disagree) is
# regrouped at most this many times, a probe interval or so each (coordinator.py), then given up on.
MAX_REGROUPS = 8

# Public names of the all-reduce, importable from here (they live in protocol.py).
__all__ = [
    "COORDINATOR_BEHIND",
    "JOIN_RPC",
    "NOT_A_MEMBER",
    "OUT_OF_WINDOW",
    "REPORT_RPC",
    "WATCH_RPC",
    "WHERE_RPC",
    "WITHDRAW_RPC",
    "AllReduceConfig",
    "CollectiveError",
    "ReduceResult",
    "SwarmCollective",
]


class SwarmCollective(Service):
    """The `Collective` over a running host and its tensor streams.

    `membership(round_id)` returns the candidate peers for a round (our id may or may not be in
    it). Call `all_reduce` with the same `round_id` and `tag` on every peer of the round.
    `current_round()`, if given, is the round this peer is at (for `round_window`; None: unknown).
    `grouping`, if given, splits each round into groups (collective/groups.py) computed from
    `roster(round_id)` — the round's roster: the swarm's members in by that round, whether
    connected to us or not, so that one dropped connection does not reshuffle our groups, and the
    same on every peer whenever their records arrived (groups.py, "Failures"; default:
    `membership`); each group all-reduces on its own, with its own coordinator and tag, among its
    members that `membership` holds. Call `all_reduce` only for rounds whose roster has us.
    `reported_step(peer)`, if given, is the inner step a peer last reported to the swarm (None:
    unknown): a coordinator stops waiting for missing peers that report steps past its round
    (coordinator.py). `present(peer)`, if given, says whether a peer is still in the swarm in
    any role (live, admitted, connected): a coordinator that left the round's candidates but is
    present (a restarted peer whose new "syncing" record reached us after we joined it at its old
    one) keeps our join (join_wait.py). `quiet(peer)`, if given, says whether a peer's heartbeats
    stopped reaching us: with an unanswered probe, our coordinator and data phases stop waiting
    for it (probe.py). `trainer_step()`, if given, is our trainer's inner step now, whatever its
    phase (None: no trainer yet): rounds past it were undone by a re-sync, and our coordinator
    and our answers to probes stop counting them (own_rounds.py).

    Lifetime: `async with SwarmCollective(...) as col:` owns the coordinator's timers and the
    background re-sync sends in the collective's own nursery, cancelled on leaving. Used without
    `async with`, the collective enters itself on first use, for the lifetime of the host.
    """

    def __init__(
        self,
        host: Host,
        streams: TensorStreams,
        membership: Callable[[int], Sequence[str]],
        config: AllReduceConfig | None = None,
        *,
        current_round: Callable[[], int | None] | None = None,
        grouping: GroupPlan | None = None,
        roster: Callable[[int], Sequence[str]] | None = None,
        reported_step: Callable[[str], int | None] | None = None,
        present: Callable[[str], bool] | None = None,
        quiet: Callable[[str], bool] | None = None,
        trainer_step: Callable[[], int | None] | None = None,
    ) -> None:
        self.host = host
        self.present = present
        self.quiet = quiet
        self.streams = streams
        self.membership = membership
        self.config = config or AllReduceConfig()
        self.current_round = current_round
        self.grouping = grouping
        self.roster = roster or membership
        self.last_groups: RoundGroups | None = None  # the grouping of the newest round we computed
        self._groups_cache: dict[tuple[int, frozenset[str]], RoundGroups] = {}
        # Who may take part: members of the round, for a round near ours (round_gate.py).
        self.gate = RoundGate(host.peer_id, self.config, membership, current_round, lambda: self._latest_round)
        # Called (inline, must not block) with each committed round's screening (contract.py).
        self.screening_listeners: list[Callable[[RoundScreening], None]] = []
        self.echoes = EchoMemory(self.config.screen_echo)  # replay screening (echoes.py)
        self._latest_round: int | None = None  # the newest round we took part in
        self._reported_step = reported_step
        self.own = OwnRounds(trainer_step)  # what our trainer entered, for our coordinator (own_rounds.py)
        self._coord = Coordinator(host, self.config, self.group, reported_step, self.own, quiet)
        self.coordinator = CoordinatorClient(host, self.config, self._coord, self._running)  # its RPCs
        # Our link rate for bandwidth-weighted parts (shares.py): configured (Mbit/s; change it
        # when the link changes, 0: measured), or measured on our sends in a recent round.
        self.uplink_mbit = self.config.uplink_mbit
        self.measured_uplink: float | None = None  # bytes/s
        # The stripe taper our joins offer (flat.py); None joins as a peer that predates it.
        self.stripe_taper: int | None = STRIPE_TAPER
        self._entering = trio.Lock()  # one start, whether entered or started on first use
        self._nested = 0  # entries while already running (they leave the lifetime as it is)
        # joins sent ahead (prepared.py), kept while our trainer is still coming to their round
        self.prepared = PreparedJoins(self.coordinator.join, self.coordinator.leave, self.own.coming)
        # our side of each round: joining, restarts at the next coordinator, attempts (member_round.py)
        self.member = MemberRounds(self, self._running, self._coord.silent)
        long = self.config.join_timeout + 120
        host.rpc.serve(JOIN_RPC, self._rpc_join, handler_timeout=long)
        host.rpc.serve(REPORT_RPC, self._rpc_report, handler_timeout=long)
        host.rpc.serve(WATCH_RPC, self._rpc_watch, handler_timeout=long)
        host.rpc.serve(WHERE_RPC, self._rpc_where, handler_timeout=5.0)
        host.rpc.serve(WITHDRAW_RPC, self._rpc_withdraw, handler_timeout=5.0)

    @property
    def peer_id(self) -> str:
        return self.host.peer_id

    @property
    def refused(self) -> dict[str, int]:
        """Requests refused, by RPC error code (for /metrics; round_gate.py)."""
        return self.gate.refused

    @property
    def uplink(self) -> float | None:
        """Our link rate in bytes/s as our joins carry it: configured, else measured, else None."""
        return self.uplink_mbit * 1e6 / 8 if self.uplink_mbit else self.measured_uplink

    def group(self, round_id: int) -> tuple[str, ...]:
        """The peers expected in our round `round_id`: the candidates, or with `grouping` the
        candidates of our group."""
        candidates = set(self.membership(round_id)) | {self.peer_id}
        groups = self.round_groups(round_id)
        if groups is not None and not groups.whole_swarm:
            candidates &= set(groups.groups[groups.index_of(self.peer_id)])
        return tuple(sorted(candidates))

    def round_groups(self, round_id: int) -> RoundGroups | None:
        """The round's grouping (None without `grouping`), from the roster with us in it."""
        if self.grouping is None:
            return None
        members = frozenset((*self.roster(round_id), self.peer_id))
        key = (round_id // self.grouping.period, members)
        groups = self._groups_cache.get(key)
        if groups is None:  # the coordinator asks every liveness interval: compute once per snapshot
            groups = self._groups_cache[key] = self.grouping.groups(sorted(members), round_id)
            for old in list(self._groups_cache)[:-8]:
                del self._groups_cache[old]
        if self.last_groups is None or groups.round_index >= self.last_groups.round_index:
            self.last_groups = groups
        return groups

    def round_is_grouped(self, round_id: int) -> bool:
        """Whether round `round_id` runs in groups smaller than the swarm (`GroupsRounds`)."""
        groups = self.round_groups(round_id)
        return groups is not None and not groups.whole_swarm

    @property
    def grouped(self) -> bool:
        """Whether our newest round ran in groups smaller than the swarm (replicas then differ)."""
        return self.last_groups is not None and not self.last_groups.whole_swarm

    # -- lifetime ------------------------------------------------------------------------------

    async def _start(self, stack: AsyncExitStack) -> None:
        self._nursery = await stack.enter_async_context(trio.open_nursery())
        await self._nursery.start(self._coord.run)

    async def __aenter__(self) -> SwarmCollective:
        async with self._entering:
            if self._stack is not None:  # already running: a peer's join started us first
                self._nested += 1
                return self
            return await super().__aenter__()

    async def __aexit__(self, *exc: object) -> bool | None:
        if self._nested:
            self._nested -= 1
            return None
        return await super().__aexit__(*exc)

    async def _running(self) -> trio.Nursery:
        """The collective's nursery; if nobody entered us, we enter for the host's lifetime."""
        async with self._entering:
            if self._stack is None:
                if self.host.nursery is None:
                    raise CollectiveError("the host is not running")
                await self.host.nursery.start(self._live_with_host)
        assert self._nursery is not None  # started above
        return self._nursery

    async def _live_with_host(
        self,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,  # type: ignore[name-defined]  # trio-typing's stale stubs shadow trio's: no TaskStatus
    ) -> None:
        await Service.__aenter__(self)
        try:
            task_status.started()
            await trio.sleep_forever()
        finally:
            await Service.__aexit__(self, None, None, None)

    # -- RPC handlers (coordinator role): each request passes the gate first (round_gate.py) --

    async def _rpc_join(self, peer: str, req: Any) -> dict[str, Any]:
        read_at = trio.current_time()  # a withdrawal of this join may overtake it (coordinator.py)
        join = JoinRequest.parse(req, to=self.peer_id)
        self.gate.check_window(join.key.round_id)
        await self.gate.require_member(peer, join.key.round_id)
        await self._running()
        return (await self._coord.join(peer, join.key, join.skipped, join.uplink, join.taper, read_at)).to_wire()

    async def _rpc_withdraw(self, peer: str, req: Any) -> dict[str, Any]:
        key = Withdrawal.parse(req, to=self.peer_id).key
        await self.gate.require_member(peer, key.round_id, wait=False)
        self._coord.withdraw(peer, key)  # the sender's own join: nobody withdraws another's
        return {}

    async def _rpc_report(self, peer: str, req: Any) -> dict[str, Any]:
        report = Report.parse(req, to=self.peer_id)
        return (await self._coord.report(peer, report)).to_wire()

    async def _rpc_watch(self, peer: str, req: Any) -> dict[str, Any]:
        watch = WatchRequest.parse(req, to=self.peer_id)
        return (await self._coord.watch(peer, watch.key, watch.attempt)).to_wire()

    async def _rpc_where(self, peer: str, req: Any) -> dict[str, Any]:
        where = WhereRequest.parse(req)
        await self.gate.require_member(peer, where.round_id, wait=False)
        return self.own.where(where.tag).to_wire()

    def waiting_for(self) -> str | None:
        """What a round of ours waits for right now, in words (for `/status`), or None."""
        return self._coord.waiting_for() or self.member.waiting

    # -- the collective ------------------------------------------------------------------------

    def _round_tag(self, round_id: int, tag: str) -> str:
        """The tag our round `round_id` runs under: with `grouping`, our group's."""
        grouping, groups = self.grouping, self.round_groups(round_id)
        return tag if grouping is None or groups is None else grouping.tag(tag, groups, self.peer_id)

    async def prepare(self, *, round_id: int, tag: str = "", within: float = 1.0) -> None:
        """Send round `round_id`'s first join now, in the background; the round is due in about
        `within` seconds. The `all_reduce` of that round then takes the reply (prepared.py). Not
        as the round's coordinator: the group then still waits for our own data (prepared.py)."""
        tag = self._round_tag(round_id, tag)
        candidates = self.group(round_id)
        if candidates[0] != self.peer_id:  # a round already prepared is left as it is
            join = self.member.join_request(round_id, tag, candidates, set())
            self.prepared.prepare(join, within, await self._running())

    async def unprepare(self, *, round_id: int, tag: str = "") -> None:
        """Round `round_id` will not run here: withdraw its prepared join (prepared.py)."""
        self.prepared.drop(round_id, self._round_tag(round_id, tag))

    async def all_reduce(self, request: RoundRequest) -> ReduceResult:
        round_id = request.round_id
        # Flattened and checked in a worker thread while the join goes out (contribution.py).
        contribution = Contribution(request.tensors, request.weight, round_id)
        contribution.start(await self._running())
        self._latest_round = max(self._latest_round or round_id, round_id)
        regroups = 0
        result: ReduceResult | None = None  # the round completed for us (own_rounds.py `ended`)
        try:
            while True:
                # Our group of the round, from our view of its roster now (computed anew when the
                # round's peers found they had grouped it differently: coordinator.py).
                tag = self._round_tag(round_id, request.tag)
                self.own.enter(round_id, tag, request.among)
                try:
                    return (result := await self.member.run(contribution, tag, request.codec))
                except Regroup as e:
                    if regroups >= MAX_REGROUPS:
                        raise CollectiveError(
                            f"round {round_id}: its peers still group it differently after {regroups} regroups ({e})"
                        ) from None
                    regroups += 1
                    log.info(kv("allreduce regrouping round", round=round_id, tag=tag, why=str(e)))
        finally:
            self.member.waiting = None
            self.own.ended(round_id, request.tag, completed=result is not None)

    async def all_gather(
        self, payload: dict[str, torch.Tensor], *, round_id: int, tag: str = "", weight: float = 1.0
    ) -> GatherResult:
        """Every member's `payload` as sent (`GathersPayloads`): sparse_gather.py over our data plane."""
        return await gather_over_streams(self, payload, round_id=round_id, tag=tag, weight=weight)

    async def where(self, peer: str, round_id: int, tag: str = "") -> WhereReply | None:
        """Where `peer` is in the series of our round `round_id` of `tag` (`WHERE_RPC`, the question
        a coordinator asks its missing peers): the round it is in and the last it ended. None when
        it cannot tell — not connected, no answer in time, or it does not count us a member — so a
        caller only ever gives up early on a peer's own word."""
        if not self.host.is_connected(peer):
            return None
        return await ask_where(self.host, peer, self._round_tag(round_id, tag), round_id)

    async def average_with(self, partner: str | None, request: RoundRequest) -> ReduceResult:
        """NoLoCo's pairwise step (pairwise.py); a partner that reports a step past this round and
        its overlap (the swarm's progress records) is not waited for."""

        def partner_past() -> bool:
            step = self._reported_step(partner) if self._reported_step is not None and partner else None
            return step is not None and step > request.round_id + request.overlap

        return await average_pair(
            self.streams,
            self.peer_id,
            partner,
            request.tensors,
            round_id=request.round_id,
            tag=request.tag,
            codec=request.codec,
            timeout=self.config.part_timeout,
            min_bandwidth=self.config.min_bandwidth,
            partner_past=partner_past,
        )
