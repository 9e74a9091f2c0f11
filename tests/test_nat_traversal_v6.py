"""NAT traversal over IPv6, specified with real peers behind real (namespace) IPv6 firewalls.

The IPv6 twin of tests/test_nat_traversal.py. A home router's IPv6 is usually a stateful
firewall, not a NAT (scripts/labs/natlab/lab.py, `ipv6=True`): each peer has a global address
that the internet sees, and nobody outside can open a connection to it. One dual-stack lab, every
peer speaking IPv6 only (listening on its global address):

    pub0  2001:db8::10      relay
    h0    2001:db8:1::10    behind r0's IPv6 firewall
    h1    2001:db8:2::10    behind r1's IPv6 firewall
    h2    fd00:3::10        behind r2's NAT66 (seen at 2001:db8::102), never probed

The whole path a private IPv6 peer takes: reachability says private (the dial-back is dropped)
while the servers observe its own global address; it reserves a slot on the relay; the other
peer reaches it through a circuit; DCUtR turns that into a direct libp2p connection by
simultaneous open; and the data plane punches its own direct TCP connection, so tensors and an
all-reduce go direct, not over the libp2p fallback. A peer that has not probed yet names the
address identify saw it at when it punches. Needs root (network namespaces, nft):
skipped with the reason otherwise. Peer logs land in pytest's tmp dir.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from scripts.labs.natlab.lab import HomeSpec, NatLab
from scripts.labs.natlab.peers import LabPeer, start_peers

from .conftest import require_natlab

pytestmark = pytest.mark.nat


@pytest.fixture(scope="module")
def lab_peers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, LabPeer]]:
    require_natlab()
    logs = tmp_path_factory.mktemp("nat_v6_peers")
    homes = [HomeSpec("cone"), HomeSpec("cone"), HomeSpec("cone", v6="nat66")]
    with NatLab(homes, public_hosts=1, ipv6=True) as lab:
        peers = start_peers(
            lab,
            {
                "pub0": {"serve_relay": True, "ipv6": True},
                "h0": {"ipv6": True},
                "h1": {"ipv6": True},
                "h2": {"ipv6": True},
            },
            log_dir=str(logs),
        )
        relay = peers["pub0"]
        for name in ("h0", "h1", "h2"):
            peers[name].call("connect", addr=relay.addr)
        for name in ("h0", "h1"):
            peers[name].call("reserve", relay=relay.addr)
            # a peer punches its data plane only once it knows it is private
            peers[name].first_probe = peers[name].call("probe")
        try:
            yield peers
        finally:
            for p in peers.values():
                p.close()


def test_peers_speak_ipv6_only(lab_peers: dict[str, LabPeer]) -> None:
    for name, ip in (
        ("pub0", "2001:db8::10"),
        ("h0", "2001:db8:1::10"),
        ("h1", "2001:db8:2::10"),
        ("h2", "fd00:3::10"),
    ):
        assert lab_peers[name].addrs == [f"/ip6/{ip}/tcp/4001/p2p/{lab_peers[name].peer_id}"]


def test_reachability_private_behind_a_v6_firewall_seen_at_its_own_address(lab_peers: dict[str, LabPeer]) -> None:
    # No NAT: the relay observes each home peer at its own global address, yet its dial-back
    # to that very address is dropped by the firewall — private, with nothing to announce.
    for name, ip in (("h0", "2001:db8:1::10"), ("h1", "2001:db8:2::10")):
        rep = lab_peers[name].first_probe
        assert rep["status"] == "private", (name, rep)
        assert rep["observed_ip"] == ip, (name, rep)
        assert rep["public_addrs"] == []
    # The relay, asked the other way round (h0 dials it back, outbound from h0): public.
    pub = lab_peers["pub0"].call("probe", servers=[lab_peers["h0"].peer_id])
    assert pub["status"] == "public", pub
    assert pub["observed_ip"] == "2001:db8::10"


def test_relayed_v6_pair_goes_direct_by_dcutr_and_data_plane_punch(lab_peers: dict[str, LabPeer]) -> None:
    relay, h0, h1 = lab_peers["pub0"], lab_peers["h0"], lab_peers["h1"]
    circuit = h1.circuit(relay)
    assert circuit.startswith("/ip6/2001:db8::10/tcp/4001/p2p/")
    conn = h0.call("connect", addr=circuit)
    assert conn["type"] == "relayed", conn
    up = h0.call("upgrade", peer=h1.peer_id, timeout=40)
    assert up["direct"], f"DCUtR did not punch the IPv6 firewalls: {up}; logs in {h0.log_path}"
    assert h1.call("conn_type", peer=h0.peer_id)["type"] == "direct"
    # The data plane is a different TCP connection: it needs its own simultaneous open.
    rid = h1.submit("recv", peer=h0.peer_id, tag="v6")
    sent = h0.call("send", peer=h1.peer_id, tag="v6", mib=8)
    got = h1.result(rid)
    assert sent["path"] == got["path"] == "direct", (sent, got, h0.log_path)
    assert sent["digest"] == got["digest"]
    # And an all-reduce between the two: every part direct, both ends agree.
    peers = [h0.peer_id, h1.peer_id]
    ids = [p.submit("allreduce", peers=peers, round=1, mib=4) for p in (h0, h1)]
    r0, r1 = h0.result(ids[0], timeout=90), h1.result(ids[1], timeout=90)
    assert r0["digest"] == r1["digest"], (r0, r1)
    assert sorted(r0["contributors"]) == sorted(peers) and not r0["excluded"], r0
    assert r0["paths"] == {h1.peer_id: "direct"} and r1["paths"] == {h0.peer_id: "direct"}, (r0, r1)
    assert r0["data_paths"] == {h1.peer_id: "direct"}, r0
    assert r1["data_paths"] == {h0.peer_id: "direct"}, r1  # h1's own punch toward h0


def test_unprobed_v6_peer_punches_the_data_plane_at_the_address_identify_saw(lab_peers: dict[str, LabPeer]) -> None:
    # h2 never probed: the only word on its public address is identify's, from the relay —
    # its NAT66 router's. Before reachability.py read /ip6/ observations, it named no address
    # in the punch ("addr must be a unicast IP address") and its tensors went over libp2p.
    relay, h0, h2 = lab_peers["pub0"], lab_peers["h0"], lab_peers["h2"]
    deadline = time.monotonic() + 10
    while (info := h2.call("info"))["observed_ip"] is None and time.monotonic() < deadline:
        time.sleep(0.1)  # sleep: poll interval (identify runs in the background of a connect)
    assert info["reachability"] == "unknown" and info["observed_ip"] == "2001:db8::102", info
    assert h2.call("connect", addr=h0.circuit(relay))["type"] == "relayed"
    # No DCUtR: the libp2p connection stays relayed, and the data plane punches on its own.
    rid = h0.submit("recv", peer=h2.peer_id, tag="unprobed")
    sent = h2.call("send", peer=h0.peer_id, tag="unprobed", mib=2)
    got = h0.result(rid)
    assert sent["path"] == got["path"] == "direct", (sent, got, h2.log_path)
    assert sent["digest"] == got["digest"]
    assert h2.call("conn_type", peer=h0.peer_id)["type"] == "relayed"
