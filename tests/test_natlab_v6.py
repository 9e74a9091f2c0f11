"""The NAT lab's IPv6 homes behave like the routers they claim to be, checked with real sockets.

An IPv6 home router usually does no NAT: each host has a global address and the router is a
stateful firewall — what a host opens gets answers, what the internet opens is dropped. That is
the condition hole punching exists for, without a mapping to predict. These checks run the IPv6
roles of tests/test_natlab.py's socket `PROBE` (`-6`) in a dual-stack lab (`NatLab(ipv6=True)`)
and specify what a peer there would observe: the internet sees a home host at its own address
(behind a "nat66" router: at the router's), an unsolicited SYN to a home host or its router gets
no answer, and two hosts behind such firewalls connect by TCP simultaneous open. The lab's IPv4
is the same as without `ipv6`, still NATed. Skipped (with the reason) where a lab cannot be built.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator

import pytest

from scripts.labs.natlab.lab import HomeSpec, LabError, NatLab, list_labs

from .test_natlab import (
    OBSERVER_PORT,
    RENDEZVOUS_PORT,
    finish,
    probe,
    read_json_line,
    start_probe,
    start_server,
)

pytestmark = pytest.mark.nat

# h0, h1: homes with an IPv6 firewall (and an IPv4 cone NAT); h2: a NAT66 home.
HOMES = [HomeSpec("cone"), HomeSpec("cone"), HomeSpec("cone", v6="nat66")]
FW_A, FW_B, NAT66 = "h0", "h1", "h2"


@pytest.fixture
def lab(root_untouched: None) -> Iterator[NatLab]:
    with NatLab(HOMES, public_hosts=2, ipv6=True) as lab:
        yield lab
    assert lab.lab_id not in list_labs()


def at(lab: NatLab, host: str, port: int) -> str:
    return f"{lab.addr6(host)}:{port}"


def start_server6(lab: NatLab, host: str, role: str, port: int) -> subprocess.Popen[str]:
    proc = start_probe(lab, host, "-6", role, port)
    assert read_json_line(proc) == {"ready": True}
    return proc


def test_the_internet_sees_a_firewalled_host_at_its_own_address_and_a_nat66_host_at_its_router(
    lab: NatLab,
) -> None:
    start_server6(lab, "pub0", "observer", OBSERVER_PORT)
    start_server6(lab, "pub1", "observer", OBSERVER_PORT)
    both = (at(lab, "pub0", OBSERVER_PORT), at(lab, "pub1", OBSERVER_PORT))
    assert lab.addr6(FW_A) == lab.public_addr6(FW_A) == "2001:db8:1::10"
    assert probe(lab, FW_A, "-6", "observe", 41000, *both)["seen"] == [at(lab, FW_A, 41000)] * 2
    # NAT66 maps onto the router's WAN address, keeping the port (the IPv6 twin of `cone`).
    assert lab.public_addr6(NAT66) == lab.addr6("r2") != lab.addr6(NAT66)
    assert probe(lab, NAT66, "-6", "observe", 41000, *both)["seen"] == [f"{lab.public_addr6(NAT66)}:41000"] * 2
    # The same host's IPv4 is still behind its NAT: dual stack, IPv4 as without `ipv6`.
    start_server(lab, "pub0", "observer", OBSERVER_PORT + 1)  # IPv4
    seen4 = probe(lab, FW_A, "observe", 41001, f"{lab.addr('pub0')}:{OBSERVER_PORT + 1}")
    assert seen4["seen"] == [f"{lab.public_addr(FW_A)}:41001"]


@pytest.mark.parametrize("host", [FW_A, NAT66])
def test_unsolicited_inbound_v6_syn_to_a_home_host_or_its_router_gets_no_answer(lab: NatLab, host: str) -> None:
    start_server6(lab, "pub0", "observer", OBSERVER_PORT)
    listener = start_probe(lab, host, "-6", "mapped_listener", 42000, at(lab, "pub0", OBSERVER_PORT))
    seen = read_json_line(listener)["seen"]
    assert seen == f"{lab.public_addr6(host)}:42000"
    # The host listens on the port its outgoing connection came from; a stranger (pub1), the
    # host it talked to (pub0, from another port) and a host behind another firewall (h1) try
    # that address, and pub1 tries the router itself: all dropped, no RST, nothing accepted.
    dials = [start_probe(lab, src, "-6", "dial", seen, 2.0) for src in ("pub0", "pub1", FW_B)]
    router = lab.hosts[host].router or ""
    dials.append(start_probe(lab, "pub1", "-6", "dial", at(lab, router, 42000), 2.0))
    results = [finish(d)["result"] for d in dials]
    assert listener.stdin is not None
    listener.stdin.write("done\n")
    listener.stdin.flush()
    assert finish(listener)["accepted"] == []
    assert results == ["timeout"] * 4, results
    # Control: the lab does route IPv6 between homes and the internet — a closed port on a
    # public host answers with RST at once.
    assert probe(lab, host, "-6", "dial", at(lab, "pub1", 42001), 2.0)["result"] == "refused"


def _punch6(lab: NatLab, a: str, b: str) -> tuple[dict, dict, dict]:
    rdv = start_server6(lab, "pub0", "rendezvous", RENDEZVOUS_PORT)
    target = at(lab, "pub0", RENDEZVOUS_PORT)
    pa = start_probe(lab, a, "-6", "punch", a, 43000, target, 5, 3.0)
    pb = start_probe(lab, b, "-6", "punch", b, 43001, target, 5, 3.0)
    return finish(rdv), finish(pa, 60), finish(pb, 60)


@pytest.mark.parametrize(("a", "b"), [(FW_A, FW_B), (FW_A, NAT66)])
def test_simultaneous_open_connects_two_hosts_behind_v6_firewalls(lab: NatLab, a: str, b: str) -> None:
    started = time.monotonic()
    paired, ra, rb = _punch6(lab, a, b)
    elapsed = time.monotonic() - started
    seen_a, seen_b = f"{lab.public_addr6(a)}:43000", f"{lab.public_addr6(b)}:43001"
    assert sorted(paired["paired"]) == sorted([seen_a, seen_b])
    assert ra["ok"] and rb["ok"], (ra, rb)
    assert (ra["peer_name"], rb["peer_name"]) == (b, a)
    # Direct: each side talks to the other's (public) address, not via pub0.
    assert (ra["remote"], rb["remote"]) == (seen_b, seen_a)
    assert (ra["local"], rb["local"]) == (at(lab, a, 43000), at(lab, b, 43001))
    print(f"v6 punch {a}-{b}: attempts {ra['attempts']}/{rb['attempts']}, {elapsed:.2f} s")


def test_without_ipv6_the_lab_has_no_ipv6_on_its_links(root_untouched: None) -> None:
    with NatLab(["cone"], public_hosts=1) as lab:
        for host in ("pub0", "r0", "h0"):
            out = lab.call(host, ["ip", "-6", "-o", "addr", "show"]).stdout
            assert [line.split()[1] for line in out.splitlines()] == ["lo"], (host, out)
        with pytest.raises(LabError, match="ipv6=True"):
            lab.addr6("h0")
