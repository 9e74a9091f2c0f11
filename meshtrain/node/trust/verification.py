"""The node's checks of sampled contributions, wired together: loss scoring (node/trust/scoring.py) and
replay spot-checks (node/trust/spot_check.py), each on when the spec asks for it.

Both listen to the collective's screened rounds after the strike book (which logs the round's
group and digest first), through one listener, run their compute in worker threads of one nursery,
and file their verdicts in the same `StrikeBook`. Loss scoring reads the outer optimizer's live φ
(its `before_state_change` hook holds the round's result back until the scoring is done, within a
bound); a spot-check trains from φ on a scratch model for as long as a round, so it copies φ for
each round it queues (a model-sized copy, only with spot-checks on). The daemon builds one `Verification` for a trainer it runs
itself (not a user's loop, not a peer with local ranks) in a swarm that screens.

Not here: what each check measures and why (their modules), how strikes count (node/trust/strikes.py).
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from meshtrain.collective.contract import RoundScreening
from meshtrain.node.trainer import Trainer
from meshtrain.node.trust.scoring import LossScorer
from meshtrain.node.trust.spot_check import SpotChecker
from meshtrain.node.trust.strikes import StrikeBook


class Verification:
    """trainer: the node's trainer. book: its `StrikeBook`. listeners: the collective's
    `screening_listeners` (ours are appended). Run `run` in a nursery for the node's lifetime."""

    def __init__(self, trainer: Trainer, book: StrikeBook, listeners: list[Callable[[RoundScreening], None]]) -> None:
        spec = trainer.spec
        self.trainer = trainer
        self.scorer = LossScorer(trainer, book) if spec.verification.score_samples else None
        self.spot_checker = SpotChecker(trainer, book) if spec.verification.spot_check_steps else None
        if self.scorer is not None or self.spot_checker is not None:
            listeners.append(self.on_round)

    def on_round(self, screening: RoundScreening) -> None:
        """The screening listener: each check takes the round (or not)."""
        for check in (self.scorer, self.spot_checker):
            if check is not None:
                check.on_round(screening)

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            for check in (self.scorer, self.spot_checker):
                if check is not None:
                    nursery.start_soon(check.run)
