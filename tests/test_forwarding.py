"""`ForwardingCollective` (collective/forwarding.py): a wrapper is every capability of the
collective it wraps, by structure alone (it names no Protocol as a base)."""

from __future__ import annotations

from meshtrain.collective import LocalSwarm
from meshtrain.collective.contract import (
    Collective,
    GathersPayloads,
    GroupsRounds,
    PreparesRounds,
    WatchesOptimizer,
)
from meshtrain.collective.forwarding import ForwardingCollective


class Tagged(ForwardingCollective):
    def __init__(self, inner: Collective) -> None:
        self.inner = inner


def test_a_wrapper_has_the_contract_and_every_capability():
    wrapped = Tagged(LocalSwarm(2).member(0))
    for protocol in (Collective, GroupsRounds, PreparesRounds, WatchesOptimizer, GathersPayloads):
        assert isinstance(wrapped, protocol), protocol.__name__
    assert ForwardingCollective.__bases__ == (object,)


def test_a_wrapper_answers_as_what_it_wraps():
    inner = LocalSwarm(2).member(1)
    wrapped = Tagged(inner)
    assert wrapped.peer_id == inner.peer_id
    assert wrapped.group(3) == inner.group(3)
    assert wrapped.round_is_grouped(3) is False  # LocalSwarm's rounds are never grouped
