"""`RoundSchedule`: at which inner steps an outer optimizer's fragments are sent and merged.

The schedule of Streaming DiLoCo (Douillard et al. 2025 §2; torchft `local_sgd.py`), of which
DiLoCo is the case of one fragment and no overlap. The trainable parameters are split into P
fragments; fragment p is sent at the inner steps s >= 1 with s ≡ p·H/P (mod H) (its `offsets`),
so at most one fragment is in flight and the peak traffic is ~1/P of a full sync. With delay
τ = 0 a round blocks (send, average, apply, merge at s); with τ >= 1 the exchange overlaps τ more
inner steps and is merged at s + τ (`merge_step`).

Rules (checked once, here; `ValueError` names the rule): H >= 1 and 1 <= P <= H with
H % P == 0 (each fragment syncs once per H steps at its own offset), and 0 <= τ < H/P (a
fragment's result is merged before the next fragment is sent).

Who reads it: the outer optimizer's round logic (optim/outer_exchanges.py) and its timing of
prepared rounds (optim/outer_round.py `RoundPreparation`), a multi-GPU peer's non-gateway ranks
that follow rank 0's rounds without an optimizer (node/ranks/sharding.py `RoundClock`), and the
swarm spec, which rejects a schedule no peer could run before it is signed (node/spec/swarm.py).
Not here: what a round computes or sends (optim/outer.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.transport.validate import is_int


@dataclass(frozen=True)
class RoundSchedule:
    """H: inner steps between two syncs of a fragment. fragments: P. delay: τ."""

    H: int
    fragments: int = 1
    delay: int = 0

    def __post_init__(self) -> None:
        H, P, delay = self.H, self.fragments, self.delay
        if not is_int(H) or H < 1:
            raise ValueError(f"H (inner steps per outer round) must be an integer >= 1, got {H!r}")
        if not is_int(P) or P < 1:
            raise ValueError(f"the number of fragments must be an integer >= 1, got {P!r}")
        if H % P:
            raise ValueError(
                f"H ({H}) must be a multiple of the number of fragments ({P}) (H % P == 0), "
                f"so that fragment p syncs at offset p·H/P"
            )
        if not is_int(delay) or not 0 <= delay < H // P:
            raise ValueError(
                f"delay τ must be an integer with 0 <= τ < H/P = {H // P}, got {delay!r}: "
                f"a fragment's result must be merged before the next fragment is sent"
            )

    @property
    def offsets(self) -> tuple[int, ...]:
        """Fragment p is sent at the inner steps s ≡ offsets[p] (mod H)."""
        return tuple(p * (self.H // self.fragments) for p in range(self.fragments))

    def sends_at(self, step: int) -> list[int]:
        """The fragments sent at inner step `step` (none at step 0)."""
        if step < 1:
            return []
        phase = step % self.H
        return [p for p, off in enumerate(self.offsets) if phase == off]

    def next_send_step(self, step: int) -> int:
        """The first inner step after `step` at which some fragment is sent."""
        return min(step + ((off - step) % self.H or self.H) for off in self.offsets)

    def merge_step(self, sent_at: int) -> int:
        """The inner step at which a fragment sent at `sent_at` is merged (= `sent_at` when blocking)."""
        return sent_at + self.delay

    def last_merge_step(self, step: int) -> int:
        """The latest inner step at or before `step` at which a fragment was merged (0: none yet).
        Between two merges the outer state does not change: a state offered at any step of that
        span is the state of this step (node/state/run_state.py `donor_snapshot`)."""
        latest = 0
        for off in self.offsets:
            sent = step - self.delay - (step - self.delay - off) % self.H  # the latest send ≡ off, ≤ step - τ
            if sent >= 1:
                latest = max(latest, sent + self.delay)
        return latest
