"""mDNS LAN discovery (meshtrain.dht.mdns), on a real LAN bridge inside the NAT lab.

Multicast must never reach the machine's own network, so this runs only in a lab namespace (marker
`nat`, needs root). One home LAN behind a cone NAT holds three hosts: two of one swarm, one of
another. The two of a swarm find and dial each other directly with no bootstrap address; the
third is never heard by them, nor they by it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from scripts.natlab.lab import HomeSpec, LabUnavailable, NatLab, check_support, cleanup_stale
from scripts.natlab.peers import LabPeer, start_peers

pytestmark = pytest.mark.nat


@pytest.fixture(scope="module")
def lan(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, LabPeer]]:
    try:
        check_support()
    except LabUnavailable as e:
        pytest.skip(f"NAT lab unavailable: {e}")
    cleanup_stale()
    logs = tmp_path_factory.mktemp("lan_peers")
    with NatLab([HomeSpec("cone", ("m0", "m1", "m2"))], public_hosts=1) as lab:
        peers = start_peers(lab, {"m0": {"mdns": "swarm-a"}, "m1": {"mdns": "swarm-a"},
                                  "m2": {"mdns": "swarm-b"}}, log_dir=str(logs))
        try:
            yield peers
        finally:
            for p in peers.values():
                p.close()


def test_peers_of_one_swarm_on_a_lan_find_and_dial_each_other(lan: dict[str, LabPeer]) -> None:
    m0, m1, m2 = lan["m0"], lan["m1"], lan["m2"]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        heard = m0.call("lan")["peers"]
        if m1.peer_id in heard and heard[m1.peer_id]["type"] == "direct":
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"m0 never heard m1 over mDNS: {heard}; logs in {m0.log_path}")
    assert heard[m1.peer_id]["addrs"][0].startswith("/ip4/10."), heard  # its LAN address
    assert m1.call("conn_type", peer=m0.peer_id)["type"] == "direct"
    # another swarm's peer on the same LAN is not heard, and does not hear us
    assert m2.peer_id not in heard
    assert set(m2.call("lan")["peers"]) == set(), m2.call("lan")
