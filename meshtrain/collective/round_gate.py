"""Who may take part in our rounds: the check every collective RPC passes before it is served.

The problem. A coordinator serves joins, reports, watches and WHERE probes to whoever connects.
A stranger — a fresh identity that is not a member — could join a future round with itself as
the expected group and void the real members' round; a peer far behind or far ahead of us could
drag a round it cannot share. Before this check, both happened.

The design. Every request is authenticated against our own view of membership: only a candidate
of the round (`membership(round_id)`, us included) may join, report, watch or ask where we are
(`require_member`; a peer that just became a trainer may not be in our replica yet, so a join
waits up to `member_wait` for its record). A probe that names no round (round -1: a state
download asking only whether its donor answers, node/state/fetch.py "Silence") is checked
against the round we are at — else every such probe of a live donor was refused and counted as
a stranger's. A join must also be for a round within `round_window`
of ours (`check_window`): our position is the caller's step counter (`current_round`; None while
we are starting or downloading, when we cannot judge), else the newest round we took part in. A
round too far ahead means *we* were left behind (stopped while the swarm went on): the joiner is
told `coordinator-behind` and goes to its next candidate rather than re-sync to us — a 3-daemon
run saw the woken lowest id refuse its two peers, 11 rounds ahead, for 30 s, each refusal a round
they spent alone. A round too far behind is `round-out-of-window`.

Wire: typed refusals (`RemoteError` codes, protocol.py: `not-a-member`, `round-out-of-window`,
`coordinator-behind`), counted by code in `refused` (for /metrics). A refused request changes
nothing. Not here: the handlers (allreduce.py), the round state (coordinator.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import trio

from meshtrain.collective.protocol import COORDINATOR_BEHIND, NOT_A_MEMBER, OUT_OF_WINDOW, AllReduceConfig
from meshtrain.transport.rpc import RemoteError

MEMBER_POLL_S = 0.1  # how often a join waiting for its sender's membership record looks again


class RoundGate:
    """The membership and round-window check of our collective's RPCs (module docstring).

    peer_id: ours. membership(round_id): the round's candidates. current_round(): the round we are
    at (None: unknown). latest_round(): the newest round we took part in (None: none)."""

    def __init__(
        self,
        peer_id: str,
        config: AllReduceConfig,
        membership: Callable[[int], Sequence[str]],
        current_round: Callable[[], int | None] | None,
        latest_round: Callable[[], int | None],
    ) -> None:
        self.peer_id, self.config = peer_id, config
        self.membership, self.current_round, self.latest_round = membership, current_round, latest_round
        self.refused: dict[str, int] = {}  # requests refused, by RPC error code (for /metrics)

    def _position(self) -> int | None:
        """The round we are at: the caller's step counter, else the newest round we took part in."""
        return self.current_round() if self.current_round is not None else self.latest_round()

    def refuse(self, code: str, text: str) -> RemoteError:
        """A typed refusal, counted."""
        self.refused[code] = self.refused.get(code, 0) + 1
        return RemoteError(code, text)

    async def require_member(self, peer: str, round_id: int, *, wait: bool = True) -> None:
        """`peer` must be a candidate of `round_id`. A peer that just became a trainer may not be
        in our replica of membership yet: with `wait`, up to `member_wait` for it to arrive."""
        if round_id < 0:  # a probe that names no round (a download's silence check): ours now
            round_id = max(self._position() or 0, 0)
        if peer == self.peer_id or peer in self.membership(round_id):
            return
        if wait:
            with trio.move_on_after(self.config.member_wait):
                while peer not in self.membership(round_id):
                    await trio.sleep(MEMBER_POLL_S)
                return
        raise self.refuse(NOT_A_MEMBER, f"{peer[-8:]} is not a member of this swarm's round {round_id}")

    def check_window(self, round_id: int) -> None:
        """A join of `round_id` must be within `round_window` of our own position."""
        window = self.config.round_window
        ref = self._position()
        if window is None or ref is None or abs(round_id - ref) <= window:
            return
        if round_id > ref:
            raise self.refuse(COORDINATOR_BEHIND, f"round {round_id} is more than {window} ahead of ours ({ref})")
        raise self.refuse(OUT_OF_WINDOW, f"round {round_id} is more than {window} from ours ({ref})")
