"""The committed result for the members that lack it: `fetch_committed`, `send_committed`.

When the coordinator commits an attempt (coordinator.py), some members may not hold its result:
their digest was in the minority (`Commit.resync`), or they did not report in time
(`Commit.unconfirmed`). The first holder of the committed digest sends them the whole result
over the data plane under the attempt's re-sync tag, and each of them receives it from that
holder and checks the digest (member_round.py `MemberRounds._commit`). Both transfers have the data plane's
deadline for their size. A send that fails is only logged: the peer may simply be gone. A fetch
that fails means we cannot take part in the round (`CollectiveError`).
"""

from __future__ import annotations

import torch

from meshtrain.collective.contract import CollectiveError
from meshtrain.collective.protocol import AllReduceConfig
from meshtrain.log import get_logger, kv
from meshtrain.transport.tensor_streams import TensorStreams, TransferError

log = get_logger(__name__)


async def fetch_committed(
    streams: TensorStreams, config: AllReduceConfig, holder: str, tag: str, like: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The committed result, shaped as `like`, from `holder` (our copy is missing or wrong)."""
    into = {k: torch.empty_like(v) for k, v in like.items()}
    deadline = config.transfer_deadline(sum(v.numel() for v in like.values()))
    try:
        got = await streams.receive(holder, tag, into=into, timeout=deadline)
    except TransferError as e:
        raise CollectiveError(f"re-sync from {holder[-8:]} failed: {e}") from None
    return got.tensors


async def send_committed(
    streams: TensorStreams, config: AllReduceConfig, peer: str, tag: str, tensors: dict[str, torch.Tensor]
) -> None:
    """Send the committed result to `peer`; a failure is logged, not raised."""
    deadline = config.transfer_deadline(sum(v.numel() for v in tensors.values()))
    try:
        await streams.send(peer, tag, tensors, timeout=deadline)
    except TransferError as e:  # the peer may simply be gone
        log.info(kv("re-sync send failed", peer=peer[-8:], error=str(e)))
