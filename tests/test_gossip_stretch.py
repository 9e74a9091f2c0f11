"""The stretched gossip phase of scripts/bench/bench_scale.py (`--gossip-stretch`): its claim is that
the swarm's messages stay the same and only come K times rarer, which holds if every period the
gossip protocols keep is K times its default at every size measured — checked here against the
same rules `SwarmView` and `Replica` run, and the view's own argument checks."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshtrain.crdt import ReplicaConfig
from meshtrain.crdt.heartbeat_rate import (
    DEFAULT_HEARTBEAT_INTERVAL,
    DEFAULT_TTL,
    heartbeat_interval_for,
    progress_gap_for,
)
from meshtrain.crdt.swarm_records import MAX_LEASE_MS
from scripts.bench.crdt_phase import run_crdt_phase, stretched, stretched_view


@given(n=st.integers(4, 256), k=st.integers(1, 28))
def test_heartbeat_lease_and_progress_gap_are_k_times_the_defaults_up_to_256_peers(n: int, k: int) -> None:
    view = stretched_view(k)
    rates = {
        "swarm_heartbeat_rate": view["swarm_heartbeat_rate"],
        "max_heartbeat_interval": view["max_heartbeat_interval"],
    }
    interval = heartbeat_interval_for(n, view["heartbeat_interval"], **rates)
    assert interval == pytest.approx(k * heartbeat_interval_for(n))
    assert progress_gap_for(n, view["heartbeat_interval"], **rates) == pytest.approx(k * progress_gap_for(n))
    lease = interval * view["ttl"] / view["heartbeat_interval"]  # as SwarmView writes it
    assert lease == pytest.approx(k * heartbeat_interval_for(n) * DEFAULT_TTL / DEFAULT_HEARTBEAT_INTERVAL)
    # SwarmView refuses arguments whose longest lease passes MAX_LEASE_MS: these stay within it.
    assert view["ttl"] * view["max_heartbeat_interval"] / view["heartbeat_interval"] * 1000 <= MAX_LEASE_MS


@pytest.mark.parametrize("k", [1, 4, 28])
def test_anti_entropy_and_gossipsub_heartbeats_stretch_and_publish_coalescing_does_not(k: int) -> None:
    base = ReplicaConfig()
    config = stretched(base, k)
    assert config.anti_entropy_interval == k * base.anti_entropy_interval
    assert config.gossip_heartbeat == k * base.gossip_heartbeat and isinstance(config.gossip_heartbeat, int)
    assert config.publish_delay == base.publish_delay


@pytest.mark.parametrize("k", [0, 2.5])
def test_a_stretch_that_is_not_a_whole_number_of_at_least_one_is_refused(k) -> None:
    with pytest.raises(ValueError, match="whole number"):
        run_crdt_phase(16, 2, 1.0, partition=False, stretch=k)
