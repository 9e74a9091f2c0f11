"""A node's state download's rules (node/state/download.py) on trio's MockClock: how long it
waits when nobody trains (`ORPHAN_WAIT`), and when a state that does not fit stops the node.

CI found it: the last peer of a two-peer swarm, its partner killed mid-round, re-synced, found no
connected trainer to download from, and retried with its backoff: 0.7, 1.9, 2.6, 4.3, 9.2, then
23.2 s, checked at 19 s, 1 s short of the 20 s rule, so it trained again after 42 s. The retries
now never sleep past the deadline.

A state that unflattens but does not fit our model or optimizer stopped the node at once, so one
lying donor (or one of another release) made every joiner that asked it exit. Now it stops only
when two donors agreed on it or the one donor we can reach sent it `MISFIT_TRIES` times; one
donor's otherwise is passed over while others remain.

The collaborators below are the download's view of the swarm (trainers' progress records, no
roster round to wait for); the rules under test are the real ones.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from meshtrain.backoff import Backoff
from meshtrain.crdt.swarm_records import PeerProgress
from meshtrain.node.phase import NodeError, Phase, StopRequest
from meshtrain.node.spec.config import NodeConfig
from meshtrain.node.state import download as download_module
from meshtrain.node.state.download import MISFIT_TRIES, ORPHAN_WAIT, MisfitDonors, SwarmDownload
from meshtrain.optim.outer_state import OuterStateError


class SwarmPresence:
    """A swarm as the download sees it: admitted, no roster round to wait for, and the connected
    trainers' progress records `trainers` (none: nobody trains)."""

    me = "us"

    def __init__(self, trainers: dict[str, PeerProgress] | None = None) -> None:
        self.trainers = trainers or {}
        self.view = SimpleNamespace(progress=dict)
        self.plan = SimpleNamespace(grouping=None)

    def candidates(self) -> list[str]:
        """Us, and the connected trainers (their progress records aside)."""
        return [self.me, *self.trainers]

    async def enter_roster(self, stop: StopRequest) -> int:
        return 0

    def not_admitted(self) -> str | None:
        return None

    def swarm_step(self) -> int | None:
        return None

    def training_peers(self, connected: bool) -> dict[str, PeerProgress]:
        return dict(self.trainers)


def lone_download(stop: StopRequest, presence: SwarmPresence | None = None) -> tuple[SwarmDownload, Any]:
    async def afinish() -> None:
        return None

    outer = SimpleNamespace(needs_resync=True, rounds=4, replicas_identical=True, afinish=afinish)
    trainer = SimpleNamespace(step=40, outer=outer, spec=SimpleNamespace(outer=SimpleNamespace(H=10)))
    dl = SwarmDownload(
        trainer,  # type: ignore[arg-type]
        presence or SwarmPresence(),  # type: ignore[arg-type]
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


def trainers(*peers: str) -> SwarmPresence:
    """Connected trainers at one step and round, all holding one φ."""
    return SwarmPresence({p: PeerProgress(p, 40, 400, 4, 0, ((4, b"phi"),)) for p in peers})


def test_one_donors_misfit_state_is_passed_over_while_others_remain():
    dl, _ = lone_download(StopRequest(), trainers("liar", "honest-a", "honest-b"))
    assert dl.donors() == ["honest-a", "honest-b", "liar"]
    assert dl.misfits.record(["liar"]) is False  # one donor's: not the swarm's
    assert dl.donors() == ["honest-a", "honest-b"]
    # Nobody else left to ask: the donor is asked again rather than nobody.
    dl.presence.trainers.pop("honest-a"), dl.presence.trainers.pop("honest-b")
    assert dl.donors() == ["liar"]


def test_a_misfit_state_two_donors_agreed_on_is_the_swarms():
    assert MisfitDonors().record(["a", "b"]) is True


def test_the_one_reachable_donors_misfit_state_is_the_swarms_after_a_few_tries():
    misfits = MisfitDonors()
    assert [misfits.record(["only"]) for _ in range(MISFIT_TRIES)] == [False] * (MISFIT_TRIES - 1) + [True]


async def test_a_misfit_from_one_donor_is_retried_and_the_swarms_stops_the_node(autojump_clock, caplog):
    caplog.set_level(logging.WARNING, logger=download_module.__name__)
    dl, _ = lone_download(StopRequest(), trainers("liar", "honest"))
    misfit = OuterStateError("exp_avg: shape [3] vs ours [2, 3]")
    await dl._misfit_from(["liar"], misfit, Backoff(), 1)
    assert "peer liar's state does not fit this node (exp_avg: shape [3] vs ours [2, 3]); asking others" in caplog.text
    with pytest.raises(
        NodeError, match=r"the swarm's state does not fit this node \(exp_avg.*same model and optimizer"
    ):
        await dl._misfit_from(["liar", "honest"], misfit, Backoff(), 2)
