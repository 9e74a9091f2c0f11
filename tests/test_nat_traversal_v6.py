"""NAT traversal over IPv6, specified with real peers behind real (namespace) IPv6 firewalls.

The IPv6 twin of tests/test_nat_traversal.py. A home router's IPv6 is usually a stateful
firewall, not a NAT (scripts/labs/natlab/lab.py, `ipv6=True`): each peer has a global address
that the internet sees, and nobody outside can open a connection to it. One dual-stack lab, every
home peer speaking IPv6 only (listening on its global address) or dual stack:

    pub0  2001:db8::10, 198.18.0.10   relay, dual stack
    h0    2001:db8:1::10              IPv6 only, behind r0's IPv6 firewall
    h1    2001:db8:2::10              IPv6 only, behind r1's IPv6 firewall
    h2    fd00:3::10                  IPv6 only, behind r2's NAT66 (seen at 2001:db8::102), never probed
    h3-h5 2001:db8:4..6::10, 10.x     dual stack: symmetric IPv4 NAT, IPv6 firewall; they reach
                                      the relay over IPv4, so its identify sees them at IPv4 only

The whole path a private IPv6 peer takes: reachability says private (the dial-back is dropped)
while the servers observe its own global address; it reserves a slot on the relay; the other
peer reaches it through a circuit; DCUtR turns that into a direct libp2p connection by
simultaneous open; and the data plane punches its own direct TCP connection, so tensors and an
all-reduce go direct, not over the libp2p fallback. A peer that has not probed yet names the
address identify saw it at when it punches. And where a home's IPv4 cannot be punched (symmetric
NAT) but its IPv6 can, dual-stack peers punch over IPv6: DCUtR and the data plane both. Needs root (network namespaces, nft):
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

DUAL = ("h3", "h4", "h5")


@pytest.fixture(scope="module")
def lab_peers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, LabPeer]]:
    require_natlab()
    logs = tmp_path_factory.mktemp("nat_v6_peers")
    homes = [HomeSpec("cone"), HomeSpec("cone"), HomeSpec("cone", v6="nat66")] + [HomeSpec("symmetric")] * 3
    with NatLab(homes, public_hosts=1, ipv6=True) as lab:
        peers = start_peers(
            lab,
            {
                "pub0": {"serve_relay": True, "ipv6": "dual"},
                **{name: {"ipv6": True} for name in ("h0", "h1", "h2")},
                **{name: {"ipv6": "dual"} for name in DUAL},
            },
            log_dir=str(logs),
        )
        relay = peers["pub0"]
        for name in ("h0", "h1", "h2"):
            peers[name].call("connect", addr=relay.addr_in("ip6"))
        for name in DUAL:
            peers[name].call("connect", addr=relay.addr_in("ip4"))
        for name in ("h0", "h1", *DUAL):
            peers[name].call("reserve", relay=relay.addr_in("ip6" if name in ("h0", "h1") else "ip4"))
            # a peer punches its data plane only once it knows it is private
            peers[name].first_probe = peers[name].call("probe")
        try:
            yield peers
        finally:
            for p in peers.values():
                p.close()


def test_home_peers_speak_ipv6_only_or_dual_stack(lab_peers: dict[str, LabPeer]) -> None:
    for name, ip in (("h0", "2001:db8:1::10"), ("h1", "2001:db8:2::10"), ("h2", "fd00:3::10")):
        assert lab_peers[name].addrs == [f"/ip6/{ip}/tcp/4001/p2p/{lab_peers[name].peer_id}"]
    for name, ip6, ip4 in (("pub0", "2001:db8::10", "198.18.0.10"), ("h3", "2001:db8:4::10", "10.4.0.10")):
        p = lab_peers[name]
        expected = [f"/ip6/{ip6}/tcp/4001/p2p/{p.peer_id}", f"/ip4/{ip4}/tcp/4001/p2p/{p.peer_id}"]
        assert sorted(p.addrs) == sorted(expected)


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
    # The dual-stack peers asked over IPv4: their symmetric NATs drop the dial-back too.
    for name, router_wan in (("h3", "198.18.0.103"), ("h4", "198.18.0.104"), ("h5", "198.18.0.105")):
        rep = lab_peers[name].first_probe
        assert (rep["status"], rep["observed_ip"]) == ("private", router_wan), (name, rep)


def test_relayed_v6_pair_goes_direct_by_dcutr_and_data_plane_punch(lab_peers: dict[str, LabPeer]) -> None:
    relay, h0, h1 = lab_peers["pub0"], lab_peers["h0"], lab_peers["h1"]
    circuit = h1.circuit(relay, "ip6")
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
    assert h2.call("connect", addr=h0.circuit(relay, "ip6"))["type"] == "relayed"
    # No DCUtR: the libp2p connection stays relayed, and the data plane punches on its own.
    rid = h0.submit("recv", peer=h2.peer_id, tag="unprobed")
    sent = h2.call("send", peer=h0.peer_id, tag="unprobed", mib=2)
    got = h0.result(rid)
    assert sent["path"] == got["path"] == "direct", (sent, got, h2.log_path)
    assert sent["digest"] == got["digest"]
    assert h2.call("conn_type", peer=h0.peer_id)["type"] == "relayed"


def test_dual_stack_pair_behind_symmetric_v4_nats_sends_tensors_direct_over_ipv6(
    lab_peers: dict[str, LabPeer],
) -> None:
    # Relayed over IPv4, no DCUtR: the data plane's own punch is the only way direct. Over IPv4
    # (the family of their observed IPs) it cannot work through symmetric NATs; it tries IPv6
    # first. Before, it punched IPv4 only, waited out its timeout and sent over libp2p.
    relay, h3, h4 = lab_peers["pub0"], lab_peers["h3"], lab_peers["h4"]
    assert h3.call("connect", addr=h4.circuit(relay, "ip4"))["type"] == "relayed"
    rid = h4.submit("recv", peer=h3.peer_id, tag="dual")
    sent = h3.call("send", peer=h4.peer_id, tag="dual", mib=4)
    got = h4.result(rid)
    assert sent["path"] == got["path"] == "direct", (sent, got, h3.log_path)
    assert sent["digest"] == got["digest"]
    assert sent["seconds"] < 3.0, sent  # no IPv4 punch timed out (4 s) first


def test_dual_stack_pair_behind_symmetric_v4_nats_goes_direct_by_dcutr_over_ipv6(
    lab_peers: dict[str, LabPeer],
) -> None:
    # DCUtR dials each other's addresses, the IPv6 ones among them, from its listen port. Before
    # libp2p_patches bound each dial to the listen address of its own family, one side dialled
    # IPv6 from its IPv4 address (or the reverse), only one SYN of the pair left, and the
    # upgrade failed all its rounds.
    relay, h4, h5 = lab_peers["pub0"], lab_peers["h4"], lab_peers["h5"]
    assert h5.call("connect", addr=h4.circuit(relay, "ip4"))["type"] == "relayed"
    up = h5.call("upgrade", peer=h4.peer_id, timeout=40)
    assert up["direct"], f"DCUtR did not punch over IPv6: {up}; logs in {h5.log_path}"
    assert h4.call("conn_type", peer=h5.peer_id)["type"] == "direct"
