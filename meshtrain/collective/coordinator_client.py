"""A member's side of the control RPCs to a round's coordinator: `CoordinatorClient`.

Problem. In every round a member joins, reports and watches at the round's coordinator. That is
either this peer (the local `Coordinator`: a plain call) or a remote peer, over an RPC that fails
in three ways that call for three different answers:
- the coordinator refuses us as a non-member or as out of its round window: its view of the swarm
  does not hold us (yet), or our round is far behind its own, and joining another coordinator would
  split the round, so we proceed alone and parity re-syncs us (`CollectiveError`);
- it is connected but not ready (its collective is still starting): try again until the join
  deadline;
- it is gone (no connection, past the deadline, or it answered garbage), or it refuses us as too
  far *ahead* of it (`coordinator-behind`: it was left behind, stopped while the swarm went on):
  restart the round at the next candidate (`CoordinatorLost`).

Design. `CoordinatorClient` makes each step one awaitable — `join`, `report`, `watch`, `leave`
(a FAIL report accusing ourselves, shielded and quiet, so the others retry without us at once)
and `withdraw` (our join no longer stands: we stopped waiting for its reply; quiet, and it waits
for a stopped coordinator to wake up to read it, up to the join deadline: coordinator.py
"Withdrawn joins") — with those failures as the two exceptions above. Replies are parsed at the edge
(protocol.py `parse_join_reply`, `parse_outcome`). Waiting for the join's reply while the
coordinator may leave the candidates is join_wait.py's.

Not here: the round loop and its restarts (member_round.py), the coordinator's state machine
(coordinator.py), the messages' wire forms and limits (protocol.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from meshtrain.collective.contract import CollectiveError
from meshtrain.collective.coordinator import Coordinator
from meshtrain.collective.protocol import (
    FAIL,
    JOIN_RPC,
    NOT_A_MEMBER,
    OUT_OF_WINDOW,
    REPORT_RPC,
    WATCH_RPC,
    WITHDRAW_RPC,
    AllReduceConfig,
    JoinReply,
    JoinRequest,
    Outcome,
    Report,
    RoundKey,
    WatchRequest,
    Withdrawal,
    parse_join_reply,
    parse_outcome,
)
from meshtrain.transport.host import Host
from meshtrain.transport.rpc import RemoteError, RpcError
from meshtrain.transport.validate import Malformed


class CoordinatorLost(Exception):
    """The coordinator is gone (or answered garbage): start the round again with the next one."""


class CoordinatorClient:
    """Control RPCs from this peer to a round's coordinator (module docstring).

    host: our host (its RPC layer and connections). config: the deadlines. local: our own
    `Coordinator`, called directly when the round's coordinator is us. running: awaited before a
    local join (it starts the collective's nursery, which holds the coordinator's timers)."""

    def __init__(
        self, host: Host, config: AllReduceConfig, local: Coordinator, running: Callable[[], Awaitable[object]]
    ) -> None:
        self.host, self.config, self.local, self._running = host, config, local, running

    async def join(self, join: JoinRequest) -> JoinReply:
        if join.key.coordinator == self.host.peer_id:
            await self._running()
            return await self.local.join(self.host.peer_id, join.key, join.skipped, join.uplink, join.taper)
        reply = await self._call(join.key.coordinator, JOIN_RPC, join)
        try:
            return parse_join_reply(reply)
        except Malformed:
            raise CoordinatorLost("malformed reply from coordinator") from None

    async def leave(self, key: RoundKey, attempt: int) -> None:
        """Tell the coordinator we are leaving the attempt (a FAIL report accusing ourselves), so
        the others retry without us at once; quiet if it cannot be told, and cancel-proof."""
        with trio.CancelScope(shield=True), trio.move_on_after(2), contextlib.suppress(CoordinatorLost, RpcError):
            await self.report(Report(key, attempt, FAIL, None, (self.host.peer_id,), (), True))

    async def withdraw(self, key: RoundKey) -> None:
        """Tell round `key`'s coordinator that our join no longer stands; quiet if it cannot be
        told. Bounded by the join deadline: a coordinator that was stopped reads it on waking."""
        if key.coordinator == self.host.peer_id:
            self.local.withdraw(self.host.peer_id, key)
            return
        with contextlib.suppress(RpcError):
            await self.host.rpc.call(
                key.coordinator, WITHDRAW_RPC, Withdrawal(key).to_wire(), timeout=self.config.join_timeout
            )

    async def report(self, report: Report) -> Outcome:
        if report.key.coordinator == self.host.peer_id:
            return await self.local.report(self.host.peer_id, report)
        return self._outcome(await self._call(report.key.coordinator, REPORT_RPC, report))

    async def watch(self, key: RoundKey, attempt: int) -> Outcome:
        if key.coordinator == self.host.peer_id:
            return await self.local.watch(self.host.peer_id, key, attempt)
        return self._outcome(await self._call(key.coordinator, WATCH_RPC, WatchRequest(key, attempt)))

    @staticmethod
    def _outcome(reply: Any) -> Outcome:
        try:
            return parse_outcome(reply)
        except Malformed:
            raise CoordinatorLost("malformed reply from coordinator") from None

    async def _call(self, coordinator: str, method: str, request: Any) -> Any:
        """The raw reply of one control RPC to a remote coordinator."""
        give_up = trio.current_time() + self.config.join_timeout
        while True:
            try:
                return await self.host.rpc.call(
                    coordinator, method, request.to_wire(), timeout=self.config.join_timeout + 120
                )
            except RemoteError as e:
                if e.code in (NOT_A_MEMBER, OUT_OF_WINDOW):
                    # Its view of the swarm does not hold us (yet), or it is far from our round:
                    # another coordinator would split the round. Proceed alone; parity re-syncs us.
                    raise CollectiveError(f"coordinator {coordinator[-8:]} refused us: {e}") from None
                # Any other refusal — `coordinator-behind` among them: it is rounds behind ours,
                # left behind while the swarm went on — sends us to the next candidate.
                raise CoordinatorLost(f"coordinator {coordinator[-8:]} refused: {e}") from None
            except RpcError as e:
                # A live connection means the coordinator is there but not ready (still starting
                # its collective): try again until the join deadline. No connection: it is gone.
                if not self.host.is_connected(coordinator) or trio.current_time() > give_up:
                    raise CoordinatorLost(f"coordinator {coordinator[-8:]} unreachable: {e}") from None
                await trio.sleep(0.2)
