"""`Backoff`: the one retry policy — exponential delays with full jitter.

Every loop that retries something the network may refuse for a while (a state download whose
donors disagree, a round whose coordinator vanished, a dial) waits `next()` seconds between
tries: `initial`, doubling up to `cap`, each drawn uniformly from [delay/2, delay] so that peers
that failed together (four joiners at once, a swarm after its creator died) do not retry in
lockstep. A retry loop never spins: the smallest wait is `initial / 2`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Backoff:
    initial: float = 1.0
    cap: float = 30.0
    factor: float = 2.0
    rng: random.Random = field(default_factory=random.Random)
    attempts: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.initial <= self.cap or self.factor < 1:
            raise ValueError("Backoff needs 0 < initial <= cap and factor >= 1")

    def next(self) -> float:
        """Seconds to wait before the next try."""
        delay = min(self.cap, self.initial * self.factor**self.attempts)
        self.attempts += 1
        return self.rng.uniform(delay / 2, delay)

    def reset(self) -> None:
        self.attempts = 0
