"""Fault-tolerant all-reduce among a swarm's peers: `SwarmCollective`.

The problem: average a dict of tensors among peers that may be SIGKILLed, stall or lie at any
moment, with every survivor ending on bit-identical results, and no survivor waiting much longer
than one deadline after a failure.

**Group and attempts.** A round's candidate group comes from the membership snapshot
(`membership(round_id)`). Its *coordinator* is the lowest peer id among them that answers — no
fixed leader: if it dies, peers fall back to the next lowest id and start over there. The
coordinator collects joins (until all candidates joined, or `join_timeout`), fixes the group of
attempt 0, and later decides each attempt's outcome. A peer that joins after the group was fixed
is told it is late and waits for the next round (`CollectiveError`). Membership is eventually
consistent, so a peer that has not yet heard of a newcomer with a lower id may think it is the
coordinator while the others follow the newcomer: while collecting joins, a coordinator re-reads
the membership and, once a lower-id candidate it is connected to appears, hands the round over —
everyone who joined it is told to start again there (`{"moved": ...}`) — instead of waiting out
its join deadline alone. Likewise a peer that entered a round late (a joiner whose downloaded state
was one round old) may wait as coordinator for peers that already finished that round: once every
missing peer has joined a later round of the same series here, nobody else will come — a majority
that joined completes the round at once; a minority (the stale peer alone) is told the round has
passed (`CollectiveError`; the node then re-syncs) instead of waiting out the deadline.
A coordinator still missing peers after `PROBE_AFTER` asks them where they are (`WHERE_RPC`): a
dropped connection can hide the lowest id from its membership while the others still follow it,
and without asking it would wait out the hard join deadline alone. Peers already past the round
count as passed; peers in it at a lower-id coordinator make it hand over there, or, if that
coordinator cannot be reached, end the round at once (`CollectiveError`). hivemind forms groups through
DHT matchmaking and PCCL through a master; a per-round, replaceable coordinator gives PCCL's
clean attempt semantics without a node the swarm cannot lose.

**Data phase** (one attempt, group of n, flattened input of M elements cut into n parts; part j
belongs to the j-th peer): reduce-scatter — every peer sends part j (optionally codec-encoded,
with its weight) to its owner, which accumulates contributions in fp32 as they arrive; then
all-gather — each owner encodes its reduced part once, decodes it back for itself, and sends the
same bytes to all. Every peer thus holds the owner's exact bits for every part, so results are
bit-identical by construction; a blake3 digest of the result, reported to the coordinator,
checks it. Each peer moves 2(n−1)/n·M elements, the bandwidth-optimal amount (as hivemind's
butterfly and PCCL's ring); all transfers of a phase run concurrently over `TensorStreams`.

**Failures.** Every transfer has a deadline scaled to its size, and peers we are waiting on are
watched for disconnection, so a killed peer is noticed in about a second and a stalled one within
a deadline. A peer that sees a failure reports it to the coordinator, which at once declares the
next attempt with the suspects removed; every peer watches for that decision while it transfers
and abandons the attempt immediately. When all members report success, the coordinator commits
if their digests agree; a minority digest is told to re-sync from a majority peer. If the
coordinator itself dies, its watchers see the RPC fail and restart the round with the next lowest
id. A peer that is itself cut off raises `CollectiveError`.

**Robust aggregation** (`robust="trimmed_mean"` or `"clipped_mean"`): owners keep every
contribution of their part and combine them coordinate-wise with the `trim` largest and smallest
values dropped, or after clipping each contribution to the median norm × `clip`. A contribution
with NaN/inf or of the wrong size is rejected outright and its sender excluded and named in
`ReduceResult.excluded`.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import trio

from meshtrain.collective.compression import CodecError, get_codec
from meshtrain.collective.contract import CollectiveError, ReduceResult
from meshtrain.collective.flat import flatten_fp32, part_bounds, result_digest, unflatten
from meshtrain.collective.pairwise import average_pair
from meshtrain.log import get_logger, kv
from meshtrain.transport.host import Host
from meshtrain.transport.rpc import RemoteError, RpcError
from meshtrain.transport.tensor_streams import TensorStreams, TransferError, payload_digest
from meshtrain.transport.validate import MALFORMED, is_int, require_map

log = get_logger(__name__)

JOIN_RPC, REPORT_RPC, WATCH_RPC = "allreduce/join", "allreduce/report", "allreduce/watch"
WHERE_RPC = "allreduce/where"
JOIN_QUIET = 0.5  # after the join deadline, fix the group once no one joined for this long
WAIT_LOG_EVERY = 5.0  # a round still waiting after this long says (again) what it waits for
NOT_A_MEMBER, OUT_OF_WINDOW = "not-a-member", "round-out-of-window"  # typed refusals (RPC codes)
PROBE_AFTER = 2.0  # a coordinator still missing peers this long asks them where they are ...
PROBE_EVERY = 2.0  # ... and again this often
FAIL_GRACE = 1.0  # after the first failure report, wait this long for the others' accounts


@dataclass(frozen=True)
class AllReduceConfig:
    join_timeout: float = 30.0  # coordinator waits this long for the expected group to join ...
    hard_join_factor: float = 3.0  # ... or up to this many times longer while only a minority joined
    part_timeout: float = 20.0  # base deadline of each transfer ...
    min_bandwidth: float = 10e6  # ... plus its size at this many bytes/s
    report_timeout: float = 10.0  # after the first success report, wait this long for the rest
    max_attempts: int = 5
    liveness_interval: float = 0.25
    robust: str = "none"  # "none" | "trimmed_mean" | "clipped_mean"
    trim: int = 1
    clip: float = 2.0
    owner_check: float = 10.0  # robust modes: a reduced part this much larger than ours is garbage
    round_window: int | None = None  # refuse joins for rounds further than this from ours (None: any)
    member_wait: float = 3.0  # how long a request from a peer not (yet) in membership waits for it

    def __post_init__(self) -> None:
        if self.robust not in ("none", "trimmed_mean", "clipped_mean"):
            raise ValueError("robust must be none, trimmed_mean or clipped_mean")


class _AttemptFailed(Exception):
    """This attempt cannot complete; carries the peers we suspect.

    `evidence` says we hold proof (their data was garbage, or we are accusing ourselves because
    we are leaving); without it the suspicion is a broken transfer, which may only be the echo of
    that peer abandoning the attempt because of someone else."""

    def __init__(self, suspects: set[str], why: str, evidence: bool = False) -> None:
        super().__init__(why)
        self.suspects = suspects
        self.evidence = evidence


class _Restart(Exception):
    """The coordinator is gone: start the round again with the next one."""


class _Moved(Exception):
    """The coordinator handed the round to a lower-id candidate: re-read the membership, go there."""


# --------------------------------------------------------------------------------------------
# Coordinator side


@dataclass
class _Attempt:
    group: tuple[str, ...]
    reports: dict[str, tuple] = field(default_factory=dict)
    outcome: dict | None = None
    decided: trio.Event = field(default_factory=trio.Event)
    first_report: float | None = None
    first_fail: float | None = None


@dataclass
class _Round:
    expected: frozenset[str]
    created: float
    round_id: int | None = None
    moved: str | None = None  # handed over to this lower-id candidate before the group was fixed
    elsewhere: str | None = None  # the missing peers are in this round at a coordinator we cannot reach
    skipped: set[str] = field(default_factory=set)  # lower ids joiners gave up on (never hand over to them)
    passed: bool = False  # the missing peers already joined a later round: nobody else will come
    last_wait_log: float = 0.0
    joins: dict[str, float] = field(default_factory=dict)
    group_fixed: trio.Event = field(default_factory=trio.Event)
    attempts: list[_Attempt] = field(default_factory=list)


class _Coordinator:
    """State the coordinator keeps per round key; driven by RPCs and by its own participation."""

    def __init__(self, collective: SwarmCollective) -> None:
        self.c = collective
        self.rounds: dict[str, _Round] = {}
        # (peer, series) -> the highest round id that peer joined here; a series is a key without
        # its round id (tag + coordinator), so it tells a stale round from the swarm's current one.
        self.latest: dict[tuple[str, str], int] = {}

    def _round(self, key: str) -> _Round:
        r = self.rounds.get(key)
        if r is None:
            head = key.split("/", 1)[0]
            round_id = int(head) if head.isdigit() else None
            # The candidates come from our own view of membership, never from a joiner's message.
            expected = self.c.group(round_id) if round_id is not None else (self.c.peer_id,)
            r = _Round(frozenset(expected), time.monotonic(), round_id)
            self.rounds[key] = r
            assert self.c.host.nursery is not None  # the host is running
            self.c.host.nursery.start_soon(self._fix_group_later, key, r)
            # Forget old rounds: keep the last 16.
            for old in list(self.rounds)[:-16]:
                del self.rounds[old]
        return r

    async def _fix_group_later(self, key: str, r: _Round) -> None:
        """Fix the group at the join deadline if a majority of the expected peers joined, else
        keep waiting up to the hard deadline: a lone early peer must not form a group of one and
        leave the majority, arriving a little later, "late" for the round."""
        cfg = self.c.config
        next_probe = r.created + PROBE_AFTER

        async def tick(dt: float) -> None:
            nonlocal next_probe
            with trio.move_on_after(dt):
                await r.group_fixed.wait()
            self._review(key, r)
            if not r.group_fixed.is_set() and time.monotonic() >= next_probe:
                await self._probe(key, r)
                next_probe = time.monotonic() + PROBE_EVERY

        with trio.move_on_after(cfg.join_timeout):
            while not r.group_fixed.is_set():
                await tick(cfg.liveness_interval)
        with trio.move_on_after(cfg.join_timeout * (cfg.hard_join_factor - 1)):
            while not r.group_fixed.is_set() and 2 * len(r.joins) <= len(r.expected):
                await tick(0.05)
            # Peers finishing the previous round arrive in a wave: once the majority is in, keep
            # the door open while joins are still arriving, so the tail of the wave is not "late".
            seen = -1
            while not r.group_fixed.is_set() and len(r.joins) != seen:
                seen = len(r.joins)
                await trio.sleep(JOIN_QUIET)
        self._fix_group(r)

    async def _probe(self, key: str, r: _Round) -> None:
        """Ask the missing candidates we are connected to where they are in this round's series.

        Our view of who coordinates can differ from theirs without a newcomer: a dropped
        connection to the lowest id hides it from our membership while the others still follow
        it, and we would wait out the hard join deadline (3 × join_timeout) alone. A missing peer
        already past this round counts as passed; one in this round at a lower-id coordinator
        makes us hand the round over there — or, if our joiners already failed to reach that
        coordinator (`skipped`), end the round at once: the swarm's round is one we cannot join."""
        if r.round_id is None:
            return
        me, tag = self.c.peer_id, _tag_of(key)
        missing = sorted(p for p in r.expected - set(r.joins) if p != me and self.c.host.is_connected(p))
        answers: dict[str, dict] = {}

        async def ask(peer: str) -> None:
            with contextlib.suppress(RpcError):
                reply = await self.c.host.rpc.call(peer, WHERE_RPC, {"tag": tag, "round": r.round_id},
                                                   timeout=PROBE_EVERY)
                if isinstance(reply, dict):
                    answers[peer] = reply

        async with trio.open_nursery() as nursery:
            for p in missing:
                nursery.start_soon(ask, p)
        if r.group_fixed.is_set():
            return
        elsewhere: dict[str, str] = {}
        passed: set[str] = set()
        for p, a in answers.items():
            at, coordinator, finished = a.get("round"), a.get("coordinator"), a.get("finished")
            if (isinstance(finished, int) and finished >= r.round_id) or (
                    isinstance(at, int) and at > r.round_id):
                passed.add(p)
            elif at == r.round_id and isinstance(coordinator, str) and coordinator < me:
                elsewhere[p] = coordinator
        reachable = sorted(c for c in set(elsewhere.values()) if c not in r.skipped)
        accounted = set(elsewhere) | passed >= r.expected - set(r.joins) - {me}
        if accounted and not elsewhere:
            self._nobody_else_coming(key, r, "the missing peers are past this round")
        elif reachable:
            self._hand_over(key, r, reachable[0], "the missing peers are in this round there")
        elif accounted:
            self._nobody_else_coming(key, r, "the missing peers are in this round at a coordinator we cannot reach",
                                     elsewhere=min(elsewhere.values()))

    def _nobody_else_coming(self, key: str, r: _Round, why: str, elsewhere: str | None = None) -> None:
        """The missing peers will not join: a majority that did completes the round now (a peer
        that cancelled and moved on must not void the round for the rest); a minority — a stale
        or cut-off coordinator, usually alone — ends it, and its members re-sync."""
        if 2 * len(r.joins) > len(r.expected):
            log.info(kv("allreduce fixing the group without the missing peers", key=key, why=why,
                        joined=len(r.joins), expected=len(r.expected)))
            self._fix_group(r)
            return
        if elsewhere is None:
            r.passed = True
        else:
            r.elsewhere = elsewhere
        r.group_fixed.set()
        log.info(kv("allreduce round ends: nobody else will come", key=key, why=why, joined=len(r.joins)))

    def _review(self, key: str, r: _Round) -> None:
        """While collecting joins: follow membership (a peer that left — its connection closed, or
        its lease ran out — is no longer waited for), end a round nobody else will come to, or
        hand it over."""
        if r.group_fixed.is_set() or r.round_id is None:
            return
        r.expected = frozenset(self.c.group(r.round_id)) | frozenset(r.joins)
        if r.expected <= set(r.joins):
            self._fix_group(r)
            return
        now = time.monotonic()
        if now - r.created >= WAIT_LOG_EVERY and now - r.last_wait_log >= WAIT_LOG_EVERY:
            r.last_wait_log = now
            log.warning(kv("outer round waiting for peers to join", round=r.round_id, tag=_tag_of(key),
                           joined=len(r.joins), expected=len(r.expected),
                           missing=",".join(p[-8:] for p in sorted(r.expected - set(r.joins))),
                           waited_s=round(now - r.created, 1)))
        series = key.split("/", 1)[1]
        missing = r.expected - set(r.joins)
        if missing and all(self.latest.get((p, series), -1) > r.round_id for p in missing):
            self._nobody_else_coming(key, r, "the missing peers joined a later round here")
            return
        me = self.c.peer_id
        lower = [p for p in self.c.group(r.round_id)
                 if p < me and p not in r.skipped and self.c.host.is_connected(p)]
        if lower:
            self._hand_over(key, r, lower[0], "a lower id is connected")

    def _hand_over(self, key: str, r: _Round, to: str, why: str) -> None:
        """Everyone who joined here is told to start the round again at `to`."""
        r.moved = to
        r.group_fixed.set()
        if self.rounds.get(key) is r:
            del self.rounds[key]
        log.info(kv("allreduce coordinator handing over", key=key, to=to[-8:], why=why))

    def _fix_group(self, r: _Round) -> None:
        if not r.group_fixed.is_set():
            r.attempts.append(_Attempt(tuple(sorted(r.joins))))
            r.group_fixed.set()
            log.debug(kv("allreduce group fixed", round=r.round_id, size=len(r.joins),
                         expected=len(r.expected)))

    async def join(self, peer: str, key: str, skipped: Sequence[str] = ()) -> dict:
        r = self._round(key)
        r.skipped.update(skipped)
        if r.round_id is not None:
            series = (peer, key.split("/", 1)[1])
            self.latest[series] = max(self.latest.get(series, -1), r.round_id)
            if len(self.latest) > 4096:  # bounded: forget the oldest entries
                for old in list(self.latest)[:1024]:
                    del self.latest[old]
        if r.group_fixed.is_set():
            if r.moved:
                return {"moved": r.moved}
            return {"late": True, "passed": r.passed, "elsewhere": r.elsewhere}
        r.joins[peer] = time.monotonic()
        r.expected |= {peer}
        if r.expected <= set(r.joins):
            self._fix_group(r)
        await r.group_fixed.wait()
        if r.moved:
            return {"moved": r.moved}
        if r.passed or r.elsewhere:
            return {"late": True, "passed": r.passed, "elsewhere": r.elsewhere}
        if peer not in r.attempts[0].group:
            return {"late": True}
        return {"attempt": 0, "group": list(r.attempts[0].group)}

    def _attempt(self, key: str, attempt: int) -> _Attempt:
        r = self.rounds.get(key)
        if r is None or not r.group_fixed.is_set() or not 0 <= attempt < len(r.attempts):
            raise RemoteError("unknown_attempt", f"{key} attempt {attempt}")
        return r.attempts[attempt]

    async def watch(self, peer: str, key: str, attempt: int) -> dict:
        a = self._attempt(key, attempt)
        if peer not in a.group:
            raise RemoteError(NOT_A_MEMBER, f"{peer[-8:]} is not in the group of {key} attempt {attempt}")
        await a.decided.wait()
        assert a.outcome is not None  # set before decided
        return a.outcome

    async def report(self, peer: str, key: str, attempt: int, status: str, digest: bytes | None,
                     suspects: Sequence[str], rejected: Sequence[str] = (), evidence: bool = False) -> dict:
        a = self._attempt(key, attempt)
        if peer not in a.group:
            raise RemoteError(NOT_A_MEMBER, f"{peer[-8:]} is not in the group of {key} attempt {attempt}")
        if not a.decided.is_set():
            a.reports[peer] = (status, digest, tuple(s for s in suspects if s in a.group), tuple(rejected),
                               bool(evidence))
            failed = any(rep[0] == "fail" for rep in a.reports.values())
            if set(a.reports) >= set(a.group):
                self._decide_failure(key, a) if failed else self._conclude(key, a)
            elif status == "fail" and a.first_fail is None:
                # One failure cancels everyone's attempt, and the transfers it breaks make
                # innocent peers look guilty: hear the others before choosing whom to drop.
                a.first_fail = time.monotonic()
                assert self.c.host.nursery is not None  # the host is running
                self.c.host.nursery.start_soon(self._decide_later, key, a, FAIL_GRACE, self._decide_failure)
            elif a.first_report is None and not failed:
                a.first_report = time.monotonic()
                assert self.c.host.nursery is not None  # the host is running
                self.c.host.nursery.start_soon(self._decide_later, key, a, self.c.config.report_timeout,
                                               self._conclude)
        await a.decided.wait()
        assert a.outcome is not None  # set before decided
        return a.outcome

    async def _decide_later(self, key: str, a: _Attempt, delay: float, decide: Callable) -> None:
        await trio.sleep(delay)
        if not a.decided.is_set() and not (decide == self._conclude and a.first_fail is not None):
            decide(key, a)

    def _decide_failure(self, key: str, a: _Attempt) -> None:
        """Choose whom to drop from the failure reports heard so far.

        A peer goes when it accused itself (it is leaving), when a majority of the peers holding
        proof blame it (garbage data: one liar cannot evict an honest peer), when it was blamed
        and never reported (it is gone; one that is still connected and blamed by a minority gets
        until the report deadline), or when a majority of all reporters blame it (it stalls
        everyone) and it holds no proof itself. If none of that singles anyone out, everyone
        blamed goes, so a retry always makes progress."""
        if a.decided.is_set():
            return
        fails = {p: rep for p, rep in a.reports.items() if rep[0] == "fail"}
        blamed: dict[str, set[str]] = {}
        proof: dict[str, set[str]] = {}
        for p, (_, _, suspects, _, evidence) in fails.items():
            for s in suspects:
                blamed.setdefault(s, set()).add(p)
                if evidence:
                    proof.setdefault(s, set()).add(p)
        provers = {p for p, rep in fails.items() if rep[4]}
        silent = {s for s in blamed if s not in a.reports}
        # A peer that a minority blames and that has not reported yet but is still connected is
        # probably just slow to report (a busy CPU): hear it before dropping it, up to the report
        # deadline. A killed peer is disconnected, and a staller is blamed by the majority.
        slow = {s for s in silent if 2 * len(blamed[s]) <= len(a.reports) and s not in proof
                and (s == self.c.peer_id or self.c.host.is_connected(s))}
        if slow and a.first_fail is not None and time.monotonic() - a.first_fail < self.c.config.report_timeout:
            assert self.c.host.nursery is not None  # the host is running
            self.c.host.nursery.start_soon(self._decide_later, key, a, 0.25, self._decide_failure)
            return
        drop = {s for s, who in proof.items() if s in who or 2 * len(who) > len(provers)}
        drop |= silent
        # Majority blame, except against a peer that holds proof: abandoning the attempt on
        # evidence breaks everyone's transfers to it, so the others' blame is only the echo.
        drop |= {s for s, who in blamed.items() if 2 * len(who) > len(a.reports) and s not in provers}
        log.info(kv("allreduce attempt failed", key=key, drop=",".join(sorted(x[-8:] for x in (drop or set(blamed)))),
                    reports=";".join(f"{p[-8:]}>{','.join(x[-8:] for x in rep[2])}{'!' if rep[4] else ''}"
                                     for p, rep in sorted(fails.items()))))
        self._retry(key, a, drop or set(blamed))

    def _retry(self, key: str, a: _Attempt, suspects: set[str]) -> None:
        if a.decided.is_set():
            return
        r = self.rounds[key]
        survivors = tuple(p for p in a.group if p not in suspects)
        if len(r.attempts) >= self.c.config.max_attempts or len(survivors) == len(a.group):
            a.outcome = {"abort": "too many failed attempts" if suspects else "no progress"}
        else:
            r.attempts.append(_Attempt(survivors))
            a.outcome = {"retry": len(r.attempts) - 1, "group": list(survivors), "excluded": sorted(suspects)}
        a.decided.set()

    def _conclude(self, key: str, a: _Attempt) -> None:
        if a.decided.is_set():
            return
        done = {p: rep for p, rep in a.reports.items() if rep[0] == "done"}
        missing = set(a.group) - set(a.reports)
        counts: dict[bytes, int] = {}
        for rep in done.values():
            counts[rep[1]] = counts.get(rep[1], 0) + 1
        if not counts:
            return self._retry(key, a, missing)
        best = max(counts.items(), key=lambda kv_: (kv_[1], kv_[0]))[0]
        majority = sorted(p for p, rep in done.items() if rep[1] == best)
        a.outcome = {
            "commit": best,
            "group": list(a.group),
            "holders": majority,
            "resync": sorted(p for p, rep in done.items() if rep[1] != best),
            "unconfirmed": sorted(missing),
            "rejected": sorted({r for rep in done.values() for r in rep[3] if r in a.group}),
        }
        a.decided.set()


def _tag_of(key: str) -> str:
    """The tag inside a round key `"{round_id}/{tag}/{coordinator}"` (peer ids have no "/")."""
    return key.split("/", 1)[1].rsplit("/", 1)[0]


# --------------------------------------------------------------------------------------------
# Participant side


class SwarmCollective:
    """The `Collective` over a running host and its tensor streams.

    `membership(round_id)` returns the candidate peers for a round (our id may or may not be in
    it). Call `all_reduce` with the same `round_id` and `tag` on every peer of the round.
    """

    def __init__(self, host: Host, streams: TensorStreams,
                 membership: Callable[[int], Sequence[str]], config: AllReduceConfig | None = None, *,
                 current_round: Callable[[], int] | None = None) -> None:
        self.host = host
        self.streams = streams
        self.membership = membership
        self.config = config or AllReduceConfig()
        self.current_round = current_round
        self.refused: dict[str, int] = {}  # requests refused, by RPC error code (for /metrics)
        self._latest_round: int | None = None  # the newest round we took part in
        self._waiting: str | None = None  # what our round waits for now (participant side)
        self._coord = _Coordinator(self)
        # Where this peer is in each tag's series of rounds, for coordinators probing (WHERE_RPC):
        # tag -> (round id, coordinator) of the round under way, and tag -> the last round ended.
        self._position: dict[str, tuple[int, str]] = {}
        self._finished: dict[str, int] = {}
        long = self.config.join_timeout + 120
        host.rpc.serve(JOIN_RPC, self._rpc_join, handler_timeout=long)
        host.rpc.serve(REPORT_RPC, self._rpc_report, handler_timeout=long)
        host.rpc.serve(WATCH_RPC, self._rpc_watch, handler_timeout=long)
        host.rpc.serve(WHERE_RPC, self._rpc_where, handler_timeout=5.0)

    @property
    def peer_id(self) -> str:
        return self.host.peer_id

    def group(self, round_id: int) -> tuple[str, ...]:
        return tuple(sorted(set(self.membership(round_id)) | {self.peer_id}))

    # -- RPC handlers (coordinator role) -------------------------------------------------------
    #
    # Every request is authenticated against our own view of membership: only a candidate of the
    # round (a member per `membership`, us included) may join, report, watch or ask where we are,
    # and only for a round near the one we are at. A fresh identity that is not a member gets a
    # typed `not-a-member` error and changes nothing — before this, a stranger could join a future
    # round with itself as the expected group and void the real members' round.

    def _refuse(self, code: str, text: str) -> RemoteError:
        self.refused[code] = self.refused.get(code, 0) + 1
        return RemoteError(code, text)

    async def _require_member(self, peer: str, round_id: int, *, wait: bool = True) -> None:
        """`peer` must be a candidate of `round_id`. A peer that just became a trainer may not be
        in our replica of membership yet: wait up to `member_wait` for it to arrive."""
        if peer == self.peer_id or peer in self.membership(round_id):
            return
        if wait:
            with trio.move_on_after(self.config.member_wait):
                while peer not in self.membership(round_id):
                    await trio.sleep(0.1)
                return
        raise self._refuse(NOT_A_MEMBER, f"{peer[-8:]} is not a member of this swarm's round {round_id}")

    def _check_window(self, round_id: int) -> None:
        window = self.config.round_window
        ref = self.current_round() if self.current_round is not None else self._latest_round
        if window is not None and ref is not None and abs(round_id - ref) > window:
            raise self._refuse(OUT_OF_WINDOW, f"round {round_id} is more than {window} from ours ({ref})")

    def _parse_key(self, key: Any) -> tuple[int, str]:
        """A round key `"{round_id}/{tag}/{coordinator}"` addressed to us: (round id, tag)."""
        if not isinstance(key, str) or len(key) > 1024:
            raise RemoteError(MALFORMED, "a round key is a str")
        head, _, rest = key.partition("/")
        tag, _, coordinator = rest.rpartition("/")
        if not head.isdigit() or len(head) > 18 or coordinator != self.peer_id:
            raise RemoteError(MALFORMED, "a round key is round/tag/coordinator, addressed to us")
        return int(head), tag

    async def _rpc_join(self, peer: str, req: Any) -> dict:
        req = require_map(req, "key")
        round_id, _ = self._parse_key(req["key"])
        self._check_window(round_id)
        await self._require_member(peer, round_id)
        skipped = req.get("skipped", [])
        if not isinstance(skipped, list) or not all(isinstance(p, str) for p in skipped):
            raise RemoteError(MALFORMED, "bad join")
        return await self._coord.join(peer, req["key"], skipped[:4096])

    async def _rpc_report(self, peer: str, req: Any) -> dict:
        req = require_map(req, "key", "attempt", "status", "digest", "suspects", "rejected", "evidence")
        if (req["status"] not in ("done", "fail") or not is_int(req["attempt"])
                or not isinstance(req["suspects"], list) or not isinstance(req["rejected"], list)
                or not isinstance(req["evidence"], bool)
                or not (req["digest"] is None or isinstance(req["digest"], bytes))):
            raise RemoteError(MALFORMED, "bad report")
        self._parse_key(req["key"])
        return await self._coord.report(peer, req["key"], req["attempt"], req["status"], req["digest"],
                                        [str(s) for s in req["suspects"][:4096]],
                                        [str(s) for s in req["rejected"][:4096]], req["evidence"])

    async def _rpc_watch(self, peer: str, req: Any) -> dict:
        req = require_map(req, "key", "attempt")
        if not is_int(req["attempt"]):
            raise RemoteError(MALFORMED, "bad watch")
        self._parse_key(req["key"])
        return await self._coord.watch(peer, req["key"], req["attempt"])

    async def _rpc_where(self, peer: str, req: Any) -> dict:
        req = require_map(req, "tag", "round")
        if not isinstance(req["tag"], str) or not is_int(req["round"]):
            raise RemoteError(MALFORMED, "bad where")
        await self._require_member(peer, req["round"], wait=False)
        at, coordinator = self._position.get(req["tag"], (-1, None))
        return {"round": at, "coordinator": coordinator, "finished": self._finished.get(req["tag"], -1)}

    def waiting_for(self) -> str | None:
        """What a round of ours waits for right now, in words (for `/status`), or None."""
        for key, r in list(self._coord.rounds.items()):
            if not r.group_fixed.is_set() and self.peer_id in r.joins:
                missing = sorted(r.expected - set(r.joins))
                return (f"round {r.round_id} ({_tag_of(key)}): waiting for {len(missing)} of "
                        f"{len(r.expected)} peers to join ({', '.join(p[-8:] for p in missing[:8])}), "
                        f"{time.monotonic() - r.created:.0f} s")
        return self._waiting

    async def _to_coordinator(self, coordinator: str, method: str, **req: Any) -> dict:
        if coordinator == self.peer_id:
            if method == JOIN_RPC:
                return await self._coord.join(self.peer_id, req["key"], req["skipped"])
            if method == REPORT_RPC:
                return await self._coord.report(self.peer_id, req["key"], req["attempt"], req["status"],
                                                req["digest"], req["suspects"], req["rejected"], req["evidence"])
            return await self._coord.watch(self.peer_id, req["key"], req["attempt"])
        give_up = time.monotonic() + self.config.join_timeout
        while True:
            try:
                reply = await self.host.rpc.call(coordinator, method, req, timeout=self.config.join_timeout + 120)
                break
            except RemoteError as e:
                if e.code in (NOT_A_MEMBER, OUT_OF_WINDOW):
                    # Its view of the swarm does not hold us (yet), or it is far from our round:
                    # another coordinator would split the round. Proceed alone; parity re-syncs us.
                    raise CollectiveError(f"coordinator {coordinator[-8:]} refused us: {e}") from None
                raise _Restart(f"coordinator {coordinator[-8:]} refused: {e}") from None
            except RpcError as e:
                # A live connection means the coordinator is there but not ready (still starting
                # its collective): try again until the join deadline. No connection: it is gone.
                if not self.host.is_connected(coordinator) or time.monotonic() > give_up:
                    raise _Restart(f"coordinator {coordinator[-8:]} unreachable: {e}") from None
                await trio.sleep(0.2)
        if not isinstance(reply, dict):
            raise _Restart("malformed reply from coordinator")
        return reply

    # -- the collective ------------------------------------------------------------------------

    async def all_reduce(self, tensors: dict[str, torch.Tensor], *, round_id: int, tag: str = "",
                         codec: str = "none", weight: float = 1.0) -> ReduceResult:
        if not math.isfinite(weight) or weight < 0:
            raise CollectiveError("weight must be finite and >= 0")
        if not all(bool(torch.isfinite(t).all()) for t in tensors.values() if t.is_floating_point()):
            # Still take part (others must not wait for us), but contribute nothing.
            log.warning(kv("allreduce input is not finite; contributing weight 0", round=round_id))
            tensors = {k: torch.zeros_like(v) for k, v in tensors.items()}
            weight = 0.0
        self._latest_round = max(self._latest_round or round_id, round_id)
        try:
            return await self._all_reduce(tensors, round_id, tag, codec, weight)
        finally:
            self._waiting = None
            self._position.pop(tag, None)
            self._finished[tag] = max(self._finished.get(tag, -1), round_id)
            for old in list(self._finished)[:-256]:  # bounded: tags are few, but not ours to trust
                del self._finished[old]

    async def _all_reduce(self, tensors: dict[str, torch.Tensor], round_id: int, tag: str, codec: str,
                          weight: float) -> ReduceResult:
        candidates = list(self.group(round_id))
        dead: set[str] = set()
        while True:
            live = [p for p in candidates if p not in dead]
            if not live:  # every candidate we tried is gone or handed over in a loop
                raise CollectiveError(f"round {round_id}: no coordinator left to join")
            coordinator = live[0]
            key = f"{round_id}/{tag}/{coordinator}"
            self._position[tag] = (round_id, coordinator)
            try:
                # A safety net over the per-step deadlines: however the round misbehaves, the
                # caller gets an error and proceeds (alone) instead of waiting forever.
                with trio.fail_after(self._round_deadline(tensors)):
                    return await self._run_round(key, coordinator, live, tensors, codec, weight, sorted(dead))
            except trio.TooSlowError:
                raise CollectiveError(f"round {round_id}: no outcome within {self._round_deadline(tensors):.0f} s"
                                      ) from None
            except _Moved as e:
                # Our view was behind: take the fresh membership (it now has the newcomer).
                candidates = sorted(set(self.group(round_id)) | {str(e)})
                log.info(kv("allreduce coordinator moved, restarting round", round=round_id, to=str(e)[-8:]))
            except _Restart as e:
                log.info(kv("allreduce coordinator lost, restarting round", round=round_id,
                            coordinator=coordinator[-8:], reason=str(e)))
                if coordinator == self.peer_id:
                    raise CollectiveError(f"round {round_id}: lost contact with the swarm ({e})") from None
                dead.add(coordinator)

    def _round_deadline(self, tensors: dict[str, torch.Tensor]) -> float:
        cfg = self.config
        transfer = cfg.part_timeout + 4 * sum(t.numel() for t in tensors.values()) / cfg.min_bandwidth
        return (cfg.join_timeout * cfg.hard_join_factor
                + cfg.max_attempts * (2 * transfer + cfg.report_timeout + FAIL_GRACE) + 30)

    async def _run_round(self, key: str, coordinator: str, expected: list[str],
                         tensors: dict[str, torch.Tensor], codec: str, weight: float,
                         skipped: list[str]) -> ReduceResult:
        log.debug(kv("allreduce join", key=key, expected=len(expected)))
        if coordinator != self.peer_id:
            self._waiting = f"round {key.split('/', 1)[0]}: waiting for coordinator {coordinator[-8:]} to form the group"
        joined = await self._to_coordinator(coordinator, JOIN_RPC, key=key, expected=expected, skipped=skipped)
        self._waiting = None
        log.debug(kv("allreduce joined", key=key, reply=",".join(sorted(joined))))
        if isinstance(joined.get("moved"), str) and joined["moved"] < coordinator:
            raise _Moved(joined["moved"])
        if isinstance(joined.get("elsewhere"), str):
            raise CollectiveError(f"{key}: the others are in this round at {joined['elsewhere'][-8:]}, "
                                  "which we cannot reach; proceed alone and re-sync")
        if joined.get("passed"):
            raise CollectiveError(f"{key}: the other peers have moved past this round; re-sync")
        if joined.get("late"):
            raise CollectiveError(f"{key}: joined after the group was formed; wait for the next round")
        attempt, group = int(joined["attempt"]), tuple(joined["group"])
        excluded: dict[str, str] = {}
        while True:
            if self.peer_id not in group:
                raise CollectiveError(f"{key}: this peer was excluded from the round")
            try:
                outcome, result, stats = await self._attempt(key, coordinator, attempt, group, tensors, codec, weight)
            except trio.Cancelled:
                # We are leaving mid-round: say so, so the others retry at once instead of
                # waiting out a deadline for our data.
                with trio.CancelScope(shield=True), trio.move_on_after(2), contextlib.suppress(_Restart, RpcError):
                    await self._to_coordinator(coordinator, REPORT_RPC, key=key, attempt=attempt, status="fail",
                                               digest=None, suspects=[self.peer_id], rejected=[], evidence=True)
                raise
            if "retry" in outcome:
                for p in outcome.get("excluded", []):
                    excluded.setdefault(p, "failed during the round")
                attempt, group = int(outcome["retry"]), tuple(outcome["group"])
                log.info(kv("allreduce retry", key=key, attempt=attempt, group=len(group)))
                continue
            if "commit" not in outcome:
                raise CollectiveError(f"{key}: {outcome.get('abort', 'aborted')}")
            holders = list(outcome["holders"])
            needy = [p for p in (*outcome["resync"], *outcome["unconfirmed"]) if p != self.peer_id]
            resync_tag = f"ar/{key}/{attempt}/resync"
            digest = stats["digest"]
            if self.peer_id in outcome["resync"] or result is None:
                result = await self._resync(resync_tag, holders[0], tensors)
                digest = result_digest(result)
            elif holders and holders[0] == self.peer_id and needy:
                assert self.host.nursery is not None  # the host is running
                for p in needy:
                    self.host.nursery.start_soon(self._send_quietly, p, resync_tag, result)
            if digest != outcome["commit"]:
                raise CollectiveError(f"{key}: result does not match the committed digest")
            for p in outcome["rejected"]:
                excluded.setdefault(p, stats["rejected"].get(p, "sent an invalid contribution"))
            contributors = tuple(p for p in group if p not in stats["zero_weight"] and p not in excluded)
            return ReduceResult(result, contributors, digest, stats["sent"], stats["received"], excluded)

    async def _attempt(self, key, coordinator, attempt, group, tensors, codec, weight):
        """Run one attempt's data phase while watching for the coordinator's decision."""
        try:
            return await self._attempt_inner(key, coordinator, attempt, group, tensors, codec, weight)
        except BaseExceptionGroup as eg:
            _raise_typed(list(_leaves(eg)))
            raise

    async def _attempt_inner(self, key, coordinator, attempt, group, tensors, codec, weight):
        state: dict[str, Any] = {"outcome": None, "result": None}
        stats = {"sent": 0, "received": 0, "zero_weight": set(), "rejected": {}}

        async with trio.open_nursery() as nursery:
            async def watch() -> None:
                state["outcome"] = await self._to_coordinator(coordinator, WATCH_RPC, key=key, attempt=attempt)
                nursery.cancel_scope.cancel()

            async def work() -> None:
                try:
                    result = await self._data_phase(key, attempt, group, tensors, codec, weight, stats)
                    digest = await trio.to_thread.run_sync(result_digest, result)
                    state["result"], state["digest"] = result, digest
                    status, suspects, evidence = "done", [], False
                except _AttemptFailed as e:
                    log.info(kv("allreduce attempt failed", key=key, attempt=attempt,
                                suspects=",".join(s[-8:] for s in e.suspects), why=str(e)))
                    status, digest, suspects, evidence = "fail", None, sorted(e.suspects), e.evidence
                log.debug(kv("allreduce report", key=key, attempt=attempt, status=status))
                await self._to_coordinator(coordinator, REPORT_RPC, key=key, attempt=attempt, status=status,
                                           digest=digest, suspects=suspects, rejected=sorted(stats["rejected"]),
                                           evidence=evidence)

            nursery.start_soon(watch)
            nursery.start_soon(work)
        log.debug(kv("allreduce attempt decided", key=key, attempt=attempt,
                     outcome=",".join(sorted(state["outcome"] or {}))))
        stats["digest"] = state.get("digest")
        return state["outcome"], state["result"], stats

    async def _data_phase(self, key, attempt, group, tensors, codec_name, weight, stats):
        n = len(group)
        me = group.index(self.peer_id)
        names = list(tensors)
        flat = flatten_fp32(tensors)
        bounds = part_bounds(flat.numel(), n)
        try:
            codec = get_codec(codec_name)
        except CodecError as e:
            raise CollectiveError(str(e)) from None
        tag = f"ar/{key}/{attempt}"
        others = [p for p in group if p != self.peer_id]
        my_lo, my_hi = bounds[me], bounds[me + 1]
        part_bytes = 4 * (my_hi - my_lo) + 64
        deadline = self.config.part_timeout + 4 * flat.numel() / self.config.min_bandwidth
        if weight == 0:
            stats["zero_weight"].add(self.peer_id)
        contributions: dict[str, torch.Tensor] = {}
        weights: dict[str, float] = {}
        failed: set[str] = set()
        # The result is assembled in place: every owner's part lands in its slice of `out`.
        out = torch.empty(flat.numel())
        # Lossless fast path: parts travel as views of `flat` (no encode copy) and reduced parts
        # are received straight into `out` (no decode, no concatenation).
        lossless = codec_name == "none"

        def encode(x: torch.Tensor) -> dict[str, torch.Tensor]:
            if lossless:
                return {"values": x}
            try:
                return codec.encode(x)
            except CodecError as e:  # our own input is not finite: we cannot take part
                raise CollectiveError(f"cannot encode our input: {e}") from None

        async def send(peer: str, subtag: str, parts: dict, meta: dict, digest: bytes | None = None) -> None:
            try:
                rep = await self.streams.send(peer, subtag, parts, meta=meta, digest=digest, timeout=deadline)
                stats["sent"] += rep.nbytes
            except TransferError as e:
                failed.add(peer)
                raise _AttemptFailed({peer}, f"send to {peer[-8:]}: {e}") from None

        async def receive(peer: str, subtag: str, into: dict | None = None) -> Any:
            try:
                got = await self.streams.receive(peer, subtag, timeout=deadline, into=into,
                                                 max_bytes=2 * part_bytes + (1 << 20))
                stats["received"] += got.nbytes
                return got
            except TransferError as e:
                failed.add(peer)
                raise _AttemptFailed({peer}, f"receive from {peer[-8:]}: {e}") from None

        try:
            await self._connect_group(others, failed)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_liveness, others, nursery.cancel_scope, failed)
                # Reduce-scatter: our slice of every part goes to its owner.
                async with trio.open_nursery() as rs:
                    for j, peer in enumerate(group):
                        if peer == self.peer_id:
                            continue
                        piece = flat[bounds[j]:bounds[j + 1]]
                        rs.start_soon(send, peer, f"{tag}/rs/{j}", encode(piece), {"w": weight})

                    async def collect(peer: str) -> None:
                        got = await receive(peer, f"{tag}/rs/{me}")
                        w = got.meta.get("w")
                        try:
                            if not isinstance(w, int | float) or not math.isfinite(w) or w < 0:
                                raise CodecError("bad weight")
                            x = codec.decode(got.tensors, (my_hi - my_lo,), torch.float32)
                        except CodecError as e:
                            stats["rejected"][peer] = f"garbage contribution: {e}"
                            return
                        if w == 0:
                            stats["zero_weight"].add(peer)
                        contributions[peer] = x
                        weights[peer] = float(w)

                    for peer in others:
                        rs.start_soon(collect, peer)
                contributions[self.peer_id] = flat[my_lo:my_hi]
                weights[self.peer_id] = weight
                reduced = await trio.to_thread.run_sync(self._reduce, contributions, weights, stats)
                mine_enc = encode(reduced)
                out[my_lo:my_hi] = reduced if lossless else codec.decode(mine_enc, (my_hi - my_lo,), torch.float32)
                # All-gather: every owner's reduced part, exactly as encoded once by its owner —
                # and hashed once, off the event loop, rather than once per receiver while sending.
                mine_digest = await trio.to_thread.run_sync(payload_digest, mine_enc) if others else None
                async with trio.open_nursery() as ag:
                    for peer in others:
                        ag.start_soon(send, peer, f"{tag}/ag/{me}", mine_enc, {}, mine_digest)

                    async def fetch(j: int, peer: str) -> None:
                        slot = out[bounds[j]:bounds[j + 1]]
                        got = await receive(peer, f"{tag}/ag/{j}", {"values": slot} if lossless else None)
                        try:
                            if lossless:
                                if not bool(torch.isfinite(slot).all()):
                                    raise CodecError("non-finite values")
                                part = slot
                            else:
                                part = codec.decode(got.tensors, (bounds[j + 1] - bounds[j],), torch.float32)
                        except CodecError as e:
                            raise _AttemptFailed({peer}, f"garbage reduced part from {peer[-8:]}: {e}", evidence=True) from None
                        if self.config.robust != "none" and part.numel():
                            # Robust combination cannot exceed the contributions' range; we only
                            # know ours, so a part vastly larger than our slice of it means its
                            # owner is lying (robust aggregation alone protects contributions only).
                            ours = float(flat[bounds[j]:bounds[j + 1]].abs().max())
                            if float(part.abs().max()) > self.config.owner_check * max(ours, 1e-12):
                                stats["rejected"][peer] = "reduced part out of range"
                                raise _AttemptFailed({peer}, f"reduced part from {peer[-8:]} out of range", evidence=True)
                        if not lossless:
                            slot.copy_(part)

                    for j, peer in enumerate(group):
                        if peer != self.peer_id:
                            ag.start_soon(fetch, j, peer)
                nursery.cancel_scope.cancel()
        except BaseExceptionGroup as eg:
            leaves = list(_leaves(eg))
            _raise_typed(leaves)
            fails = [e for e in leaves if isinstance(e, _AttemptFailed)]
            if fails and len(fails) == len(leaves):
                # Proof outweighs broken transfers, which may only echo others abandoning the attempt.
                fails = [f for f in fails if f.evidence] or fails
                raise _AttemptFailed(set().union(*(f.suspects for f in fails)), str(fails[0]),
                                     evidence=fails[0].evidence) from None
            raise
        if failed:
            raise _AttemptFailed(set(failed), "peers disconnected during the attempt")
        return unflatten(out, tensors, names)

    def _reduce(self, contributions: dict[str, torch.Tensor], weights: dict[str, float], stats: dict) -> torch.Tensor:
        """Combine the contributions to our part (runs in a worker thread)."""
        peers = sorted(contributions)  # a fixed order: the owner's result must not depend on arrival
        bad = [p for p in peers if not torch.isfinite(contributions[p]).all()]
        for p in bad:
            stats["rejected"][p] = "non-finite values"
        peers = [p for p in peers if p not in bad]
        robust = self.config.robust
        if robust == "none" or len(peers) < 3:
            total = sum(weights[p] for p in peers)
            acc = torch.zeros_like(contributions[peers[0]]) if peers else None
            if acc is None or total == 0:
                return torch.zeros_like(next(iter(contributions.values())))
            for p in peers:
                if weights[p]:
                    acc.add_(contributions[p], alpha=weights[p])
            return acc.div_(total)
        peers = [p for p in peers if weights[p] > 0]
        stack = torch.stack([contributions[p] for p in peers])
        if robust == "clipped_mean":
            norms = stack.norm(dim=1)
            limit = norms.median() * self.config.clip
            scale = torch.clamp(limit / norms.clamp_min(1e-30), max=1.0)
            return (stack * scale[:, None]).mean(dim=0)
        k = min(self.config.trim, (len(peers) - 1) // 2)
        if k == 0:
            return stack.mean(dim=0)
        srt = stack.sort(dim=0).values
        return srt[k : len(peers) - k].mean(dim=0)

    async def _connect_group(self, others: list[str], failed: set[str]) -> None:
        """Open data-plane connections to the whole group first: setup is off the critical path,
        and an unreachable member is a suspect before any data moves."""
        async def one(peer: str) -> None:
            try:
                with trio.fail_after(self.config.part_timeout):
                    await self.streams.prepare(peer)
            except (TransferError, trio.TooSlowError) as e:
                failed.add(peer)
                log.info(kv("allreduce peer unreachable", peer=peer[-8:], error=repr(e)))

        async with trio.open_nursery() as nursery:
            for p in others:
                nursery.start_soon(one, p)
        if failed:
            raise _AttemptFailed(set(failed), "group members unreachable")

    async def _watch_liveness(self, peers: list[str], scope: trio.CancelScope, failed: set[str]) -> None:
        """Cancel the attempt as soon as a peer we depend on drops its connection."""
        while True:
            await trio.sleep(self.config.liveness_interval)
            gone = [p for p in peers if not self.host.is_connected(p)]
            if gone:
                failed.update(gone)
                scope.cancel()
                return

    async def _resync(self, tag: str, holder: str, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Fetch the committed result from a peer that holds it (our copy is missing or wrong)."""
        into = {k: torch.empty_like(v) for k, v in like.items()}
        deadline = self.config.part_timeout + 4 * sum(v.numel() for v in like.values()) / self.config.min_bandwidth
        try:
            got = await self.streams.receive(holder, tag, into=into, timeout=deadline)
        except TransferError as e:
            raise CollectiveError(f"re-sync from {holder[-8:]} failed: {e}") from None
        return got.tensors

    async def _send_quietly(self, peer: str, tag: str, tensors: dict[str, torch.Tensor]) -> None:
        deadline = self.config.part_timeout + 4 * sum(v.numel() for v in tensors.values()) / self.config.min_bandwidth
        try:
            await self.streams.send(peer, tag, tensors, timeout=deadline)
        except TransferError as e:  # the peer may simply be gone
            log.info(kv("re-sync send failed", peer=peer[-8:], error=str(e)))

    async def average_with(self, partner: str | None, tensors: dict[str, torch.Tensor], *, round_id: int,
                           tag: str = "", codec: str = "none") -> ReduceResult:
        return await average_pair(self.streams, self.peer_id, partner, tensors, round_id=round_id, tag=tag,
                                  codec=codec, timeout=self.config.part_timeout,
                                  min_bandwidth=self.config.min_bandwidth)



def _raise_typed(leaves: list[BaseException]) -> None:
    """Surface the one error that matters out of a trio exception group."""
    for kind in (CollectiveError, _Restart):
        for e in leaves:
            if isinstance(e, kind):
                raise e from None


def _leaves(eg: BaseException):
    if isinstance(eg, BaseExceptionGroup):
        for e in eg.exceptions:
            yield from _leaves(e)
    else:
        yield eg
