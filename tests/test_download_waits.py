"""How long a node's state download waits when nobody trains (node/state/download.py,
`ORPHAN_WAIT`), on trio's MockClock.

CI found it: the last peer of a two-peer swarm, its partner killed mid-round, re-synced, found no
connected trainer to download from, and retried with its backoff: 0.7, 1.9, 2.6, 4.3, 9.2, then
23.2 s, checked at 19 s, 1 s short of the 20 s rule, so it trained again after 42 s. The retries
now never sleep past the deadline. The collaborators below are the download's view of a lone
node (no connected trainer, nobody to wait for in a roster); the rule under test is the real one.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import trio

from meshtrain.node.phase import Phase, StopRequest
from meshtrain.node.spec.config import NodeConfig
from meshtrain.node.state import download as download_module
from meshtrain.node.state.download import ORPHAN_WAIT, SwarmDownload


class LonePresence:
    """A node alone in its swarm, as the download sees it: admitted, no roster round to wait
    for, and no connected peer that trains."""

    def __init__(self) -> None:
        self.view = SimpleNamespace(progress=dict)
        self.plan = SimpleNamespace(grouping=None)

    async def enter_roster(self, stop: StopRequest) -> int:
        return 0

    def not_admitted(self) -> str | None:
        return None

    def swarm_step(self) -> int | None:
        return None

    def training_peers(self, connected: bool) -> dict[str, Any]:
        return {}


def lone_download(stop: StopRequest) -> tuple[SwarmDownload, Any]:
    async def afinish() -> None:
        return None

    outer = SimpleNamespace(needs_resync=True, rounds=4, replicas_identical=True, afinish=afinish)
    trainer = SimpleNamespace(step=40, outer=outer, spec=SimpleNamespace(outer=SimpleNamespace(H=10)))
    dl = SwarmDownload(
        trainer,  # type: ignore[arg-type]
        LonePresence(),  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]  # no donor, so no stream is opened
        NodeConfig(),
        None,  # type: ignore[arg-type]
        lambda withheld: None,
        phase=Phase(),
        stop=stop,
    )
    return dl, trainer


async def test_a_lone_node_trains_on_its_own_state_once_the_orphan_wait_is_over(autojump_clock, caplog):
    caplog.set_level(logging.WARNING, logger=download_module.__name__)
    dl, trainer = lone_download(StopRequest())
    assert await dl.download() is True
    # Exactly the rule's 20 s (less one retry's floor), not a backoff's overshoot of up to 30 s.
    assert ORPHAN_WAIT <= trio.current_time() <= ORPHAN_WAIT + 0.1
    assert trainer.outer.needs_resync is False
    assert "nobody is training to download from; training on our own state" in caplog.text
    assert dl.waiting is None


async def test_a_stop_ends_the_orphan_wait_at_once(autojump_clock):
    stop = StopRequest()
    dl, trainer = lone_download(stop)

    async def stop_at(t: float) -> None:
        await trio.sleep(t)  # sleep: the stop's moment (virtual time: MockClock)
        stop.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stop_at, 7.0)
        assert await dl.download() is False
    assert trio.current_time() == 7.0
    assert trainer.outer.needs_resync is True  # nothing was decided for a node that stops
