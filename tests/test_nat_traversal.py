"""NAT traversal, specified with real peers behind real (namespace) NATs.

One lab for the module: three public hosts on the lab's "internet" and four homes, each with one
peer behind its own NAT router:

    pub0  relay, default (training-sized) limits        h0  cone NAT        h2  symmetric NAT
    pub1  relay: 2 reservations, 1 MiB per circuit      h1  cone NAT        h3  symmetric NAT
    pub2  relay: reservations live 3 s, circuits 3 s

Every peer is a process (tests/proc_nat_peer.py) running Host + TensorStreams + reachability +
relay + hole punching, driven over stdin/stdout. Each test uses its own pairs of peers, so the
tests do not depend on each other's order. Needs root (network namespaces, nft): skipped with
the reason otherwise. Peer logs land in pytest's tmp dir; a failing assertion names them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from scripts.labs.natlab.lab import NatLab
from scripts.labs.natlab.peers import LabPeer, LabPeerError, start_peers

from .conftest import require_natlab

pytestmark = pytest.mark.nat

TIGHT_RELAY = {"max_reservations": 2, "circuit_bytes": 1 << 20}
SHORT_RELAY = {"reservation_ttl": 3, "circuit_duration": 3}


@pytest.fixture(scope="module")
def lab_peers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, LabPeer]]:
    require_natlab()
    logs = tmp_path_factory.mktemp("nat_peers")
    with NatLab(["cone", "cone", "symmetric", "symmetric"], public_hosts=3) as lab:
        peers = start_peers(
            lab,
            {
                "pub0": {"serve_relay": True},
                "pub1": {"serve_relay": True, "relay": TIGHT_RELAY},
                "pub2": {"serve_relay": True, "relay": SHORT_RELAY},
                "h0": {},
                "h1": {"relay": {"refresh_fraction": 0.5}},
                "h2": {},
                "h3": {},
            },
            log_dir=str(logs),
        )
        relay = peers["pub0"]
        for name in ("pub1", "pub2", "h0", "h1", "h2", "h3"):
            peers[name].call("connect", addr=relay.addr)
        for name in ("h0", "h1", "h2", "h3"):
            peers[name].call("reserve", relay=relay.addr)
            # a peer punches its data plane only once it knows it is private
            peers[name].first_probe = peers[name].call("probe")
        try:
            yield peers
        finally:
            for p in peers.values():
                p.close()


def test_reachability_private_behind_nat_and_public_on_internet(lab_peers: dict[str, LabPeer]) -> None:
    # pub1 asks pub0 to dial it back on a fresh connection: it gets through.
    pub = lab_peers["pub1"].call("probe")
    assert pub["status"] == "public", pub
    assert pub["observed_ip"] == "198.18.0.11"
    # Behind either NAT the dial-back is dropped, although the asker *is* connected to the
    # server (the case py-libp2p's AutoNAT v1 reports as public).
    for name, router_wan in (
        ("h0", "198.18.0.100"),
        ("h1", "198.18.0.101"),
        ("h2", "198.18.0.102"),
        ("h3", "198.18.0.103"),
    ):
        rep = lab_peers[name].first_probe
        assert rep["status"] == "private", (name, rep)
        assert rep["observed_ip"] == router_wan, (name, rep)
        assert rep["public_addrs"] == []


def test_dcutr_upgrades_cone_pair_and_data_plane_goes_direct(lab_peers: dict[str, LabPeer]) -> None:
    relay, h0, h1 = lab_peers["pub0"], lab_peers["h0"], lab_peers["h1"]
    conn = h0.call("connect", addr=h1.circuit(relay))
    assert conn["type"] == "relayed", conn
    up = h0.call("upgrade", peer=h1.peer_id, timeout=20)
    assert up["direct"], f"DCUtR did not punch the cone pair: {up}; logs in {h0.log_path}"
    assert h1.call("conn_type", peer=h0.peer_id)["type"] == "direct"
    # The data plane is a different TCP connection: it needs its own simultaneous open.
    rid = h1.submit("recv", peer=h0.peer_id, tag="cone")
    sent = h0.call("send", peer=h1.peer_id, tag="cone", mib=8)
    got = h1.result(rid)
    assert sent["path"] == got["path"] == "direct", (sent, got)
    assert sent["digest"] == got["digest"]


def test_symmetric_pair_falls_back_to_relay(lab_peers: dict[str, LabPeer]) -> None:
    relay, h1, h2, h3 = lab_peers["pub0"], lab_peers["h1"], lab_peers["h2"], lab_peers["h3"]
    for a, b in ((h2, h3), (h1, h2)):  # symmetric <-> symmetric, cone <-> symmetric
        assert a.call("connect", addr=b.circuit(relay))["type"] == "relayed"
        rid = b.submit("recv", peer=a.peer_id, tag=f"sym-{a.name}")
        sent = a.call("send", peer=b.peer_id, tag=f"sym-{a.name}", mib=4, timeout=60)
        got = b.result(rid, timeout=60)
        # The punch fails (the predicted port is wrong), so tensors go through the relay.
        assert sent["path"] == got["path"] == "libp2p", (sent, got)
        assert sent["digest"] == got["digest"]
        assert a.call("conn_type", peer=b.peer_id)["type"] == "relayed"


def test_relay_limits_enforced(lab_peers: dict[str, LabPeer]) -> None:
    tight, h0, h1, h2, h3 = (lab_peers[n] for n in ("pub1", "h0", "h1", "h2", "h3"))
    # At most two reservations: the third peer is refused with the relay's status.
    h2.call("reserve", relay=tight.addr)
    h3.call("reserve", relay=tight.addr)
    with pytest.raises(LabPeerError, match="RESOURCE_LIMIT_EXCEEDED"):
        h1.call("reserve", relay=tight.addr)
    # At most 1 MiB per circuit: a small transfer passes, a big one is cut off by the relay.
    assert h0.call("connect", addr=h3.circuit(tight))["type"] == "relayed"
    rid = h3.submit("recv", peer=h0.peer_id, tag="small")
    assert h0.call("send", peer=h3.peer_id, tag="small", mib=0.25)["path"] == "libp2p"
    h3.result(rid)
    rid = h3.submit("recv", peer=h0.peer_id, tag="big", timeout=30)
    big = h0.call("send", peer=h3.peer_id, tag="big", mib=4, timeout=30, check=False)
    assert not big["ok"], big
    assert not h3.result(rid, timeout=40, check=False)["ok"]
    assert tight.call("relay_stats")["stats"]["limit_resets"] >= 1


def test_relay_reservation_refresh_and_circuit_duration(lab_peers: dict[str, LabPeer]) -> None:
    short, h0, h1, h2, h3 = (lab_peers[n] for n in ("pub2", "h0", "h1", "h2", "h3"))
    h1.call("keep", relays=[short.addr])  # refreshed at half its 3 s life
    h2.call("reserve", relay=short.addr)  # reserved once, never refreshed
    time.sleep(4.5)  # sleep: past the reservations' 3 s life (the refresh is what is tested)
    held = [r for r in h1.call("reservations")["reservations"] if r["relay"] == short.peer_id]
    assert held and held[0]["refreshes"] >= 2, held
    assert held[0]["expires_in"] > 0
    # The refreshed reservation still works; the one-off reservation lapsed, and a peer without
    # a live reservation cannot be reached through that relay.
    assert h3.call("connect", addr=h1.circuit(short))["type"] == "relayed"
    with pytest.raises(LabPeerError, match="NO_RESERVATION"):
        h0.call("connect", addr=h2.circuit(short))
    # Circuits through this relay live 3 s: the relayed connection is then cut.
    time.sleep(4.0)  # sleep: past the circuits' 3 s life (what is tested)
    assert h3.call("conn_type", peer=h1.peer_id)["type"] is None


def test_upnp_on_a_lan_without_a_gateway_maps_nothing_within_its_deadline(lab_peers: dict[str, LabPeer]) -> None:
    # The home LAN has a router but no UPnP IGD (as most do): SSDP goes unanswered on the LAN
    # bridge, the mapper gives up within its deadline and the peer carries on, still private.
    h0 = lab_peers["h0"]
    out = h0.call("upnp", deadline=3.0, timeout=20)
    assert out["gateway"] is False and out["mapped"] == [], out
    assert out["seconds"] < 3.0 + 2.0, out
    assert h0.call("probe")["status"] == "private"
