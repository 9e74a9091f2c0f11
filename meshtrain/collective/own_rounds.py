"""What this peer's own trainer asked of its collective, as the peer's coordinator must know it.

The problem. A peer's coordinator serves every peer's joins, its own trainer's among them, and
judges who is still coming to a round it holds. Two facts only our own trainer knows were missing
from that judgement, and each left a grouped swarm's rounds waiting out their hard join deadline
(3 × the join timeout, 45 s by default) in tests/test_grouped_daemons.py:
- **Our trainer went past the round.** It gave up on its round elsewhere (proceeded alone,
  re-synced) and entered a later round of the same series, while its coordinator still held a
  round it was expected in — joined by a partner, waiting for us. Other peers tell a coordinator
  where they are through their progress records and the WHERE probe; our own trainer's progress
  reaches us no sooner than theirs, and the probe asks only others.
- **A follow-up exchange among fewer peers.** A grouped round's consensus term (optim/outer.py)
  is a second exchange of the same round among the peers the first one committed
  (`RoundRequest.among`). Expected as the round's whole group, it waited for a member that had
  left the first exchange, and that peer never came: it was re-syncing.

The design. The collective records, as its trainer enters each exchange (`enter`), the newest
round of each tag's series and a follow-up's peers; the coordinator asks `past` (our trainer
ended the key's round, or entered a later round of the key's series or of the series it follows
up: an exchange "f0.phi" follows "f0"), `among` (the peers a follow-up's round key is cut to)
and `entered_as` (the tag our trainer is in a round under: another group's when our groups and
the coordinator's disagree, coordinator.py "Groups that disagree"; none once the round ended).
A round that our partner and we completed under our tag, while a peer that grouped it otherwise
waits here under its own, is past for us, not a reason to regroup: seen in CI, where the two
regrouped until `MAX_REGROUPS` ran out. A round our trainer failed (it proceeded alone) is not
past, for us or for a prober (`where`'s last ended round counts completed rounds only): it
re-syncs and, while the swarm is still in that round, enters it again (optim/outer.py
`entry_step`). Counted as past, a swarm whose members had all failed one round told each other
so as each re-entered it, and none ever completed it (seen in a loaded run of
tests/test_nat_swarm.py). A re-sync that takes our trainer back (`trainer_step`, its inner step
now, is below a round we recorded: it downloaded the swarm's state from before rounds it had
completed or entered alone) undoes those rounds here at once, not at its next entry: between the
download and that entry lie the re-sync's pause and our partners' rounds, and a probe answered
"finished" meanwhile made the coordinator of the very round we were coming back to end it as
passed — two peers that had each completed a round alone then re-synced, paused and told each
other so in turn, and no round formed again (a loaded CI run of tests/test_daemon_matrix.py).
All are our own trainer's calls, never a remote
peer's claim, so they cannot be used to cut a round short. The same record answers other
coordinators' WHERE probes (`at`, `ended`, `where`): the round of each series our trainer is in,
at which coordinator and under which tag, and the last it completed — about the series, whatever
group's tag the prober asks with.

Failures. A coordinator whose own trainer has not reached a follow-up yet expects the round's
whole group until it does (its next review, a liveness interval later, cuts it), as before this.
What is not here: other peers' positions (coordinator.py: the progress records; missing_peers.py: the WHERE probe).
"""

from __future__ import annotations

from collections.abc import Callable

from meshtrain.collective.groups import GROUP_TAG
from meshtrain.collective.protocol import RoundKey, WhereReply

KEPT = 64  # follow-ups remembered (a few per round: one per fragment)
SERIES_KEPT = 256  # series whose last ended round is remembered (few, but not ours to trust)


def tag_series(tag: str) -> str:
    """A round tag without its group suffix (collective/groups.py `GroupPlan.tag`): the series its
    rounds belong to, whatever group each round puts us in."""
    return tag.split(GROUP_TAG, 1)[0]


class OwnRounds:
    """Our trainer's exchanges: the newest round per series, and the peers of each follow-up."""

    def __init__(self, trainer_step: Callable[[], int | None] | None = None) -> None:
        # Our trainer's inner step now (None: unknown), whatever its phase; a round's id is the
        # inner step it is sent at, so rounds past it are undone by a re-sync (`_follow_trainer`).
        self._trainer_step = trainer_step
        self._newest: dict[str, int] = {}  # series -> the round id our trainer entered last
        self._entered: dict[str, tuple[int, str]] = {}  # series -> (round id, tag) of its newest entry
        # For other coordinators' probes (WHERE_RPC): series -> (round id, coordinator, tag) of the
        # exchange under way, and series -> the last round ended.
        self._position: dict[str, tuple[int, str, str]] = {}
        self._finished: dict[str, int] = {}
        self._among: dict[tuple[int, str], frozenset[str]] = {}  # (round id, tag) -> a follow-up's peers

    def enter(self, round_id: int, tag: str, among: tuple[str, ...] = ()) -> None:
        """Our trainer enters exchange `round_id` under `tag` (with its group suffix), among
        `among` when it is a follow-up (empty: the round's group)."""
        series = tag_series(tag)
        # The round we are in now, not the furthest: a re-sync may take our trainer back into a
        # round it ended (it proceeded alone, and the swarm is still in that round), which it
        # neither passed nor ended any more.
        self._newest[series] = round_id
        if self._finished.get(series, -1) >= round_id:
            self._finished[series] = round_id - 1
        self._entered[series] = (round_id, tag)  # a regrouped round is entered again, under its new tag
        if among:
            self._among[(round_id, tag)] = frozenset(among)
            for old in list(self._among)[:-KEPT]:
                del self._among[old]

    def at(self, key: RoundKey) -> None:
        """Our trainer's exchange of `key`'s series is now round `key` at its coordinator."""
        self._position[tag_series(key.tag)] = (key.round_id, key.coordinator, key.tag)

    def ended(self, round_id: int, tag: str, *, completed: bool) -> None:
        """Our trainer's exchange `round_id` under `tag` ended: `completed` (it has the round's
        result: past it for good) or failed (it proceeds alone and re-syncs — into that round
        again when the swarm is still in it: not past it)."""
        series = tag_series(tag)
        self._position.pop(series, None)
        if self._entered.get(series, (None,))[0] == round_id:
            del self._entered[series]  # under no tag now: a coordinator's probe must not regroup for it
        if not completed:
            return
        self._finished[series] = max(self._finished.get(series, -1), round_id)
        for old in list(self._finished)[:-SERIES_KEPT]:
            del self._finished[old]

    def where(self, tag: str) -> WhereReply:
        """Where our trainer is in `tag`'s series, whatever group's tag it asks with: the answer
        to a coordinator's WHERE probe (missing_peers.py)."""
        self._follow_trainer()
        series = tag_series(tag)
        at, coordinator, entered = self._position.get(series, (-1, None, None))
        return WhereReply(at, coordinator, self._finished.get(series, -1), entered)

    def among(self, key: RoundKey) -> frozenset[str] | None:
        """The peers round `key` is cut to (a follow-up our trainer entered), or None."""
        return self._among.get((key.round_id, key.tag))

    def entered_as(self, key: RoundKey) -> str | None:
        """The tag under which our trainer is in round `key`'s round id of its series (another
        group's, when our groups differ from the coordinator's), or None: not entered, or ended."""
        self._follow_trainer()
        entered = self._entered.get(tag_series(key.tag))
        return entered[1] if entered is not None and entered[0] == key.round_id else None

    def past(self, key: RoundKey) -> bool:
        """Whether our trainer completed round `key` of its series (under whichever group's tag),
        or entered a later round of its series or of a series `key`'s follows up ("f0" for
        "f0.phi"): it will not come to round `key`. The follow-up itself comes after the round it
        follows ends, so only `key`'s own series' completed rounds count; a failed round does not
        (the trainer re-syncs, and with the swarm still in that round, enters it again)."""
        self._follow_trainer()
        series = tag_series(key.tag)
        if self._finished.get(series, -1) >= key.round_id:
            return True
        return any(
            newest > key.round_id for s, newest in self._newest.items() if series == s or series.startswith(s + ".")
        )

    def coming(self, key: RoundKey) -> bool:
        """Whether our trainer is still on its way to round `key`: its inner step is not past the
        round's (a round's id is the step it is sent at) and it has not gone past the round
        otherwise (`past`). False where our trainer's step is unknown. A join prepared for the
        round is kept while this holds (prepared.py "Failures")."""
        step = self._trainer_step() if self._trainer_step is not None else None
        return step is not None and step <= key.round_id and not self.past(key)

    def _follow_trainer(self) -> None:
        """Undo the rounds our trainer's state is now before (module docstring: a re-sync took it
        back): not ended, not entered, not under way any more."""
        step = self._trainer_step() if self._trainer_step is not None else None
        if step is None:
            return
        for series, finished in self._finished.items():
            self._finished[series] = min(finished, step)
        for series in [s for s, newest in self._newest.items() if newest > step]:
            del self._newest[series]
        for series in [s for s, (round_id, _) in self._entered.items() if round_id > step]:
            del self._entered[series]
        for series in [s for s, (round_id, _, _) in self._position.items() if round_id > step]:
            del self._position[series]
