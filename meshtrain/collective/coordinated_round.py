"""What a coordinator keeps of one round it coordinates: its joins, its group and its attempts.

A plain record, read and written by the coordinator (coordinator.py: group formation, joins,
attempts) and by its policy for the candidates that have not joined (missing_peers.py). It lives
apart from both so that each can name it without importing the other.

Not here: what fills it in (coordinator.py, missing_peers.py), the attempts' rules
(attempt_rules.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import trio

from meshtrain.collective.attempt_rules import Attempt
from meshtrain.collective.protocol import Abort, Late, RoundKey


@dataclass
class CoordinatedRound:
    key: RoundKey
    expected: frozenset[str]
    created: float
    moved: str | None = None  # handed over to this lower-id candidate before the group was fixed
    elsewhere: str | None = None  # the missing peers are in this round at a coordinator we cannot reach
    skipped: set[str] = field(default_factory=set)  # lower ids joiners gave up on (never hand over to them)
    passed: bool = False  # the missing peers already joined a later round: nobody else will come
    regroup: bool = False  # the missing peers are in this round under another grouping of it
    last_wait_log: float = 0.0
    joins: dict[str, float] = field(default_factory=dict)
    uplinks: dict[str, float | None] = field(default_factory=dict)  # each joiner's rate, bytes/s
    tapers: dict[str, int | None] = field(default_factory=dict)  # each joiner's offered stripe taper
    group_fixed: trio.Event = field(default_factory=trio.Event)
    attempts: list[Attempt] = field(default_factory=list)
    base: int = 0  # the id of its first attempt (coordinator.py, "Attempt ids"); attempts[i] is attempt base + i

    @property
    def missing(self) -> frozenset[str]:
        return self.expected - set(self.joins)

    @property
    def aborted(self) -> bool:
        """Its last attempt was aborted: nobody committed the round here."""
        return (
            bool(self.attempts) and self.attempts[-1].decided.is_set() and isinstance(self.attempts[-1].outcome, Abort)
        )

    def ended_without_us(self) -> Late:
        return Late(self.passed, self.elsewhere, regroup=self.regroup)
