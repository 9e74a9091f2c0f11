"""Parity: every peer of a swarm holds the same outer parameters φ after the same round — checked
continuously, and repaired within a round when it does not hold.

The problem. The all-reduce makes every member of *one group* end a round with bit-identical
results (digests agree, or the minority re-syncs). Across groups nothing does: membership is
eventually consistent, so under churn two coordinators can each form a group for the same round
(a soak saw round 3860 complete twice, as two groups of two), and a peer that proceeded alone
holds its own φ. Without a check such a peer trains on, silently diverged, for as long as it
lives — in the soak, one peer's eval loss climbed from 1.57 to 2.10 over 26 rounds while nothing
logged it.

The design. After every outer round a peer hashes φ (`phi_digest`, blake3 over the outer
parameters in name order, a few ms for 100 MB) and publishes `(round, digest)` for its last
few rounds in its signed CRDT progress record (`SwarmView.report_progress(phi=...)`). Any peer
can then compare, for round r, the digests of every live trainer that reports one:

- **The rule.** The digest held by the most peers at round r wins. A tie goes to the digest
  whose holders include the lowest peer id (the peer every group would have chosen as its
  coordinator: a deterministic choice every peer computes alike from the same records). With no
  majority at all — every peer alone — the same rule still picks exactly one state.
- **Minority.** A peer whose digest at r is not the winner is *out of step*: it logs it at
  WARNING, `/status` shows it (`training.parity`), and it re-syncs from the winner's holders —
  the node downloads their state (multi-donor, verified), which they publish after every round,
  so the repair lands within about one round.
- **When to judge.** The round judged is our newest one that every live trainer has reached
  (published a digest at or past it; each record carries the last 8 rounds, so peers a round or
  two apart still compare the same round). A peer that has not reached it holds the verdict
  open for at most `settle_s` (3 s, or two of our recent rounds where those are shorter, at
  least `MIN_SETTLE_S`) after that round completed: then our newest round at least
  that old is judged with the peers that reached it (a stopped or cut-off peer must not keep it
  open; the clock is per round, so rounds shorter than `settle_s` do not keep it open either —
  a 10-minute soak at 0.5 s rounds saw two lineages run 13 rounds apart while a SIGSTOPped peer
  held every verdict "pending"). A peer that joined after the round (its digests start later)
  is not counted.

What it does not cover: optimizers whose replicas differ by design (NoLoCo gossips with one
partner; `OuterOptimizer.replicas_identical = False` turns the check off), grouped rounds
(collective/groups.py: while the swarm's rounds run in groups, each group applies its own mean,
and a group's members come from different groups the round before, so no two digests need agree;
the node sets `paused_by` to the collective's say, and the verdict is "unchecked" with its
reason for as long as rounds are grouped), and a majority that
is wrong together (every peer trusts the largest group; a colluding majority is admission's and
verification's problem, not parity's).

Withheld and solo rounds. A round a peer proceeded alone in because the round failed (a
coordinator refused its join or vanished) leaves a φ known not to be the swarm's: no digest is
published for it, and the peer re-syncs before its next round (`ParityMonitor.withhold`; a CI
soak saw such a peer publish its own φ as a member's for two rounds). Its state donor still
offers that state, marked `phi_withheld` (where every trainer went on alone, offering nothing
stalled them); a joiner declines it while another trainer published a φ for that round or a
later one, and otherwise enters it withholding the digest too (`SwarmDownload._solo_offer`: a
30-minute soak saw a joiner record a donor's alone round beside the swarm's digest).
`alone_rounds` counts the rounds whose result was our own contribution alone while other
trainers were in the membership, and `solo_rounds` those of them — formed as a group of one, not
failed and withheld — in which another trainer still trained (a fresh progress record), was
connected to us and was within the round window of the round (`SwarmSpec.round_window`): a peer
that may hold a second φ for the same round, the fork the parity rule then heals. A partner
further behind is refused in the round and re-syncs before it can share it (a coordinator fixes
its group without it: collective/missing_peers.py `without_silent`), so holds no φ for it; a
30-minute soak's two "solo" rounds were such, beside peers 12 and 27 rounds behind that the
coordinator had just left out. A round whose group shrank to us by retries (`survived_rounds`: its other
members were dropped as failed or silent) is not solo: the coordinator's decision dropped them,
each is told the round failed for it (`CollectiveError`), proceeds alone, withholds its φ and
re-syncs, so ours is the round's only φ — the collective surviving a vanished peer, as designed
(a 30-minute soak's 8 "solo" rounds were all of this kind: the partner SIGSTOPped, or refused at
another round and leaving). A member that left our round by itself (its coordinator lost, or
gone from its candidates: collective/join_wait.py) may complete the same round at another
coordinator: a retry that would leave one member after such a leaver is aborted instead
(collective/attempt_rules.py `next_group`), so the last member withholds — and so is a retry
that would leave one member while a peer outside the round's group trains (it may be in the
round at a coordinator whose view had it when ours did not: a 30-minute soak's survived round
was a second φ so); with two or more left, their
φ and the leaver's group's are a split that the parity check heals, as any other (the chaos soak
counts those in `parity_split_rounds`). A round alone whose partners' connections closed
(killed: most of a 10-minute soak's 79 rounds alone were such) or whose partners stopped
training is not solo: nobody else holds a φ for it (a killed peer re-syncs when it comes back).
Nor is a round alone beside a trainer that carries our own state, or is fetching it
(`BesideAlone.ours`): it asked us for our state of the round before, or took it, and has not
passed the round since, so it can complete the round only with us (we are past it), in another
group (whose members count as partners themselves) or alone (then withheld: the round ended
beside us, who train outside it). A 30-minute soak's only trainer, its rounds 0.1 s apart,
completed its next round 20 ms after a restarted peer downloaded its state, and, in the same
soak, another 60 ms before a restart's download of its state ended (the restart's progress
record from its last life still fresh): both counted solo, though each restart, refused,
withheld and re-synced — it happened in most 30-minute soaks (stop 63's "benign solo class").
A restart that has not asked anyone for a state yet is no trainer at all: its membership record
says when its life began, and its progress record of the last life, fresh for a few heartbeats
more, no longer counts as training (node/presence.py `training_peers`; stop 64's fourth solo
round was such a restart). Nor does a partner we have heard no progress from since our connection
to it opened (node/presence.py `heard_since_connected`): a restart connects before its new
membership record reaches us, and its last life's records, still fresh, then read as this
life's (stop 67's solo round: a partner killed 9 s before, its restart connected for 1 s).
A partner that went silent (SIGSTOP, a cut cable) is solo for as long as its progress stays
fresh (~3 heartbeats), then gone for all we can tell: availability is chosen over a quorum — a
lone survivor trains on, and when the silent side comes back the parity rule picks one lineage
(`parity_split_rounds` in the chaos soak counts such splits). But a round formed as a group of
one is also withheld — not published, though not failed — when another trainer's record (any, a
dead peer's too) holds a φ for that round or a later one, or within 30 s of a pause of our own
(node/state/run_state.py `_alone_beside_the_swarm`): the swarm may have completed it without us.
A DEBUG soak's peer, SIGSTOPped 12 s, woke to its partners killed and published its own φ for
five rounds they had completed during the stop. The chaos soak sums all three counts.

`judge` is a pure function of the records and a clock value, tested without a network
(`tests/test_parity.py`); `ParityMonitor` keeps a node's own digests and its last verdict.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import blake3
import torch

from meshtrain.crdt.swarm_view import MAX_PHI_DIGESTS
from meshtrain.optim.outer_round import RoundReport

# In a donor's snapshot meta: its φ is its own, from a round it spent alone (digest withheld).
PHI_WITHHELD = "phi_withheld"
DIGEST_BYTES = 16  # of blake3: plenty to tell states apart, small in every progress record
DEFAULT_SETTLE_S = 3.0  # seconds a round's verdict waits for peers that have not reached it ...
MIN_SETTLE_S = 1.0  # ... or two rounds where rounds are shorter, but never less than this

Digest = TypeVar("Digest", bytes, str)


@dataclass(frozen=True)
class AloneRounds:
    """Rounds whose result was our own contribution alone, by how they came to be (module
    docstring, "Withheld and solo rounds"): `formed` in a group of one from the start, `survived`
    in a group whose other members the round dropped (retries left us alone), `failed`
    proceeding alone after the round failed for us."""

    formed: int = 0
    survived: int = 0
    failed: int = 0

    @classmethod
    def of(cls, rounds: Iterable[RoundReport], me: str) -> AloneRounds:
        """Sort `rounds` (each alone: `RoundReport.alone`) by kind; `me`: our peer id. A round's
        `peers` are its members and those it excluded, so any peer but us there was dropped."""
        formed = survived = failed = 0
        for r in rounds:
            if r.error:
                failed += 1
            elif set(r.peers) <= {me}:
                formed += 1
            else:
                survived += 1
        return cls(formed, survived, failed)


@dataclass(frozen=True)
class BesideAlone:
    """The trainers beside rounds we completed alone (`of`; module docstring, "Withheld and solo
    rounds"): `partners` may hold a φ of their own for those rounds, `behind` cannot (further
    behind than the round window: they re-sync first), `ours` carry our own state or are
    fetching it (they asked us for our state of the round before, or took it, and have not
    passed the round since)."""

    partners: tuple[str, ...]
    behind: tuple[str, ...]
    ours: tuple[str, ...]

    @classmethod
    def of(
        cls, steps: Mapping[str, int], first: int, window: int, period: int, taken: Mapping[str, int]
    ) -> BesideAlone:
        """`steps`: the step each other trainer (training, connected to us) reports; `first`: the
        first of the rounds alone (its round id, a step); `window`: the round window; `period`:
        inner steps per round; `taken`: the step of the newest of our states each peer asked us
        for or fetched (node/state/donor.py `StateDonor.states_taken`)."""
        partners, behind, ours = [], [], []
        for peer, step in sorted(steps.items()):
            if step < first - window:
                behind.append(peer)
            elif taken.get(peer, -1) >= first - period and step < first:
                ours.append(peer)
            else:
                partners.append(peer)
        return cls(tuple(partners), tuple(behind), tuple(ours))


def phi_digest(outer_params: Mapping[str, torch.Tensor]) -> bytes:
    """blake3 over the outer parameters' fp32 bytes, in name order (names included)."""
    h = blake3.blake3()
    for name in sorted(outer_params):
        t = outer_params[name].detach()
        h.update(name.encode())
        if t.numel():
            h.update(t.to("cpu", torch.float32).contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.digest(length=DIGEST_BYTES)


@dataclass(frozen=True)
class ParityVerdict:
    """How this peer's φ at `outer_round` compares with the swarm's."""

    status: str  # "ok" | "minority" | "pending" | "unchecked"
    outer_round: int | None = None
    mine: bytes | None = None
    majority: bytes | None = None
    holders: tuple[str, ...] = ()  # peers holding the winning digest (sorted)
    agreeing: int = 0  # peers holding our digest, us included
    compared: int = 0  # peers with a digest at this round, us included
    reason: str = ""

    def as_status(self) -> dict:
        return {
            "status": self.status,
            "round": self.outer_round,
            "mine": self.mine.hex() if self.mine else None,
            "majority": self.majority.hex() if self.majority else None,
            "holders": [p[-8:] for p in self.holders],
            "agreeing": self.agreeing,
            "compared": self.compared,
            "reason": self.reason,
        }


def winning_digest(holders: Mapping[Digest, set[str]]) -> Digest:
    """The digest held by the most peers; a tie goes to the one whose holders include the lowest
    peer id. `holders` must not be empty. Digests are bytes on the node, hex where an observer
    (the chaos soak) judges from `/status`: the same rule either way."""
    return min(holders, key=lambda d: (-len(holders[d]), min(holders[d]), d))


def judge(
    me: str,
    mine: Sequence[tuple[int, bytes]],
    others: Mapping[str, Sequence[tuple[int, bytes]]],
    *,
    completed_at: Mapping[int, float],
    now: float,
    settle_s: float = DEFAULT_SETTLE_S,
) -> ParityVerdict:
    """Judge our φ against the digests `others` (live trainers other than us, each with its
    published `(round, digest)` list, oldest first) published.

    The round judged is the newer of: the newest of ours that every other peer has reached (it
    holds a digest there, or its digests are already past it), and the newest of ours that
    completed `settle_s` or more ago (`completed_at`: round -> monotonic time), judged with the
    peers that have reached it. A peer that stalls (SIGSTOPped, cut off) therefore holds a verdict
    open for `settle_s`, never longer: the clock runs per round, so a swarm whose rounds are
    shorter than `settle_s` is still judged. With neither, the verdict is "pending"."""
    if not mine:
        return ParityVerdict("pending", reason="no round completed yet")
    reached = [phi[-1][0] if phi else -1 for phi in others.values()]
    settled = [r for r, _ in mine if all(top >= r for top in reached)]
    old = [r for r, _ in mine if r in completed_at and now - completed_at[r] >= settle_s]
    if not settled and not old:
        rnd = mine[-1][0]
        behind = sum(1 for top in reached if top < rnd)
        return ParityVerdict(
            "pending", outer_round=rnd, mine=mine[-1][1], reason=f"{behind} peers have not reached round {rnd}"
        )
    rnd = max(settled[-1:] + old[-1:])
    my_digest = dict(mine)[rnd]
    holders: dict[bytes, set[str]] = {my_digest: {me}}
    for peer, phi in others.items():
        digest = dict(phi).get(rnd)
        if digest is not None:  # else: it joined after rnd, or rnd fell out of its window
            holders.setdefault(digest, set()).add(peer)
    win = winning_digest(holders)
    compared = sum(len(h) for h in holders.values())
    verdict = dict(
        outer_round=rnd,
        mine=my_digest,
        majority=win,
        holders=tuple(sorted(holders[win])),
        agreeing=len(holders[my_digest]),
        compared=compared,
    )
    if win == my_digest:
        return ParityVerdict("ok", **verdict)
    return ParityVerdict(
        "minority",
        reason=f"φ at round {rnd} is held by {len(holders[my_digest])} of "
        f"{compared} peers; {len(holders[win])} hold another",
        **verdict,
    )


class ParityMonitor:
    """A node's own φ digests and its latest verdict. `record` from the thread that owns φ (the
    trainer's), `check` from the trio side with the swarm's progress records."""

    def __init__(self, me: str, *, enabled: bool = True, settle_s: float = DEFAULT_SETTLE_S) -> None:
        self.me = me
        self.enabled = enabled
        self.settle_s = settle_s
        self.history: list[tuple[int, bytes]] = []
        self.completed_at: dict[int, float] = {}  # round -> when we completed it (monotonic)
        self.verdict = ParityVerdict(
            "unchecked" if not enabled else "pending", reason="" if enabled else "replicas differ by design (NoLoCo)"
        )
        self.resyncs = 0
        self.withheld = 0  # rounds whose digest we did not publish: we proceeded alone (`withhold`)
        self.withheld_round: int | None = None  # the newest of them
        self.alone_rounds = 0  # rounds whose φ is our own alone, others in the membership (`completed_alone`)
        self.solo_rounds = 0  # ... of them formed (not failed), while a partner trained and was connected
        self.survived_rounds = 0  # ... of them whose group shrank to us: its other members were dropped
        # Why the check is off for now ("" or None: it is on); the node wires grouped rounds here.
        self.paused_by: Callable[[], str] | None = None

    def record(self, outer_round: int, digest: bytes) -> None:
        """Our φ after `outer_round` rounds. A re-sync may move the round backwards or repeat it:
        the history is then restarted, so rounds stay strictly increasing."""
        if self.history and outer_round <= self.history[-1][0]:
            self.history = [(r, d) for r, d in self.history if r < outer_round]
        self.history.append((outer_round, digest))
        del self.history[:-MAX_PHI_DIGESTS]
        kept = {r for r, _ in self.history}
        self.completed_at = {r: t for r, t in self.completed_at.items() if r in kept}
        self.completed_at[outer_round] = time.monotonic()

    def withhold(self, outer_round: int) -> None:
        """Our φ after `outer_round` is known to differ from the swarm's (we proceeded alone after
        a failed round, and re-sync next): publish no digest for it, count it."""
        if self.withheld_round != outer_round:
            self.withheld_round = outer_round
            self.withheld += 1

    def is_withheld(self, outer_round: int) -> bool:
        """Whether our φ after `outer_round` is one we withheld (`withhold`): our state donor
        marks such a state when it offers it (`RunState.donor_snapshot`). Not once a digest was
        recorded for that round since (a re-sync that landed there holds the swarm's φ)."""
        recorded = bool(self.history) and self.history[-1][0] == outer_round
        return self.enabled and self.withheld_round == outer_round and not recorded

    def completed_alone(self, rounds: AloneRounds, training_partners: Collection[str]) -> bool:
        """We completed `rounds` whose result was our own contribution alone while other trainers
        were in the membership (`AloneRounds`: formed, survived — the others the round dropped
        were told it failed for them and re-sync — or failed, withheld and re-synced);
        `training_partners`: the trainers that train now, are connected to us and are within the
        round window of these rounds (module docstring). Returns
        whether the formed ones count as solo (module docstring): with a partner training and
        reachable, a second φ for the same rounds may exist; with none — its connection closed
        (killed) or its progress gone stale (stopped, cut off) — ours is the only one, for all
        we can tell from here."""
        self.alone_rounds += rounds.formed + rounds.survived + rounds.failed
        self.survived_rounds += rounds.survived
        if not rounds.formed or not training_partners:
            return False
        self.solo_rounds += rounds.formed
        return True

    def check(self, others: Mapping[str, Sequence[tuple[int, bytes]]]) -> ParityVerdict:
        if not self.enabled:
            return self.verdict
        paused = self.paused_by() if self.paused_by is not None else ""
        if paused:
            self.verdict = ParityVerdict("unchecked", reason=paused)
            return self.verdict
        self.verdict = judge(
            self.me, self.history, others, completed_at=self.completed_at, now=time.monotonic(), settle_s=self.settle()
        )
        return self.verdict

    def settle(self) -> float:
        """How long a round's verdict waits for peers that have not reached it: `settle_s`, or two
        of our recent rounds where those are shorter (at least `MIN_SETTLE_S`), so a swarm of fast
        rounds is judged within a few rounds, not a few dozen."""
        times = sorted(self.completed_at.values())
        gaps = sorted(b - a for a, b in zip(times, times[1:], strict=False))
        if len(gaps) < 3:
            return self.settle_s
        return min(self.settle_s, max(MIN_SETTLE_S, 2 * gaps[len(gaps) // 2]))

    def status(self) -> dict:
        out = self.verdict.as_status()
        out["resyncs"] = self.resyncs
        out["withheld"] = self.withheld
        out["alone_rounds"] = self.alone_rounds
        out["solo_rounds"] = self.solo_rounds
        out["survived_rounds"] = self.survived_rounds
        return out
