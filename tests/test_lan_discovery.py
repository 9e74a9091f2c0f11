"""mDNS LAN discovery (meshtrain.dht.mdns), on a real LAN bridge inside the NAT lab.

Multicast must never reach the machine's own network, so this runs only in a lab namespace (marker
`nat`, needs root). One home LAN behind a cone NAT holds three hosts: two of one swarm, one of
another. The two of a swarm find and dial each other directly with no bootstrap address; the
third is never heard by them, nor they by it. Then two `meshtrain node start --mdns` daemons
holding the same swarm spec, given no bootstrap and no join address, form one swarm on that LAN.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.labs.natlab.lab import HomeSpec, NatLab
from scripts.labs.natlab.peers import ROOT, LabPeer, start_peers

from .conftest import require_natlab

pytestmark = pytest.mark.nat


@pytest.fixture(scope="module")
def lab_lan(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NatLab, dict[str, LabPeer]]]:
    require_natlab()
    logs = tmp_path_factory.mktemp("lan_peers")
    with NatLab([HomeSpec("cone", ("m0", "m1", "m2"))], public_hosts=1) as lab:
        peers = start_peers(
            lab, {"m0": {"mdns": "swarm-a"}, "m1": {"mdns": "swarm-a"}, "m2": {"mdns": "swarm-b"}}, log_dir=str(logs)
        )
        try:
            yield lab, peers
        finally:
            for p in peers.values():
                p.close()


@pytest.fixture
def lan(lab_lan: tuple[NatLab, dict[str, LabPeer]]) -> dict[str, LabPeer]:
    return lab_lan[1]


def test_peers_of_one_swarm_on_a_lan_find_and_dial_each_other(lan: dict[str, LabPeer]) -> None:
    m0, m1, m2 = lan["m0"], lan["m1"], lan["m2"]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        heard = m0.call("lan")["peers"]
        if m1.peer_id in heard and heard[m1.peer_id]["type"] == "direct":
            break
        time.sleep(0.5)  # sleep: poll interval
    else:
        pytest.fail(f"m0 never heard m1 over mDNS: {heard}; logs in {m0.log_path}")
    assert heard[m1.peer_id]["addrs"][0].startswith("/ip4/10."), heard  # its LAN address
    assert m1.call("conn_type", peer=m0.peer_id)["type"] == "direct"
    # another swarm's peer on the same LAN is not heard, and does not hear us
    assert m2.peer_id not in heard
    assert set(m2.call("lan")["peers"]) == set(), m2.call("lan")


def test_two_nodes_with_mdns_form_a_swarm_on_a_lan_without_any_address(
    lab_lan: tuple[NatLab, dict[str, LabPeer]], tmp_path: Path
) -> None:
    lab = lab_lan[0]
    cli = [sys.executable, "-m", "meshtrain.node.cli"]
    a, b = tmp_path / "a", tmp_path / "b"
    made = subprocess.run(
        [*cli, "swarm", "create", "--data-dir", str(a), "--model", "gpt-tiny", "--steps", "0", "--H", "10"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert made.returncode == 0, made.stderr
    b.mkdir()
    shutil.copy(a / "swarm.json", b / "swarm.json")  # b holds the spec, but no one's address
    procs, logs = {}, {}
    for host, d in (("m0", a), ("m1", b)):
        logs[host] = tmp_path / f"{host}.log"
        with open(logs[host], "w") as err:
            procs[host] = lab.run(
                host,
                [
                    *cli,
                    "--log-level",
                    "INFO",
                    "node",
                    "start",
                    "--data-dir",
                    str(d),
                    "--mdns",
                    "--listen",
                    f"/ip4/{lab.addr(host)}/tcp/4011",
                    "--status-port",
                    "0",
                    "--threads",
                    "1",
                    "--no-nat",
                    "--no-upnp",
                ],
                cwd=str(ROOT),
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
    try:
        deadline, peers = time.monotonic() + 60, {}
        while time.monotonic() < deadline:
            for host, d in (("m0", a), ("m1", b)):
                assert procs[host].poll() is None, logs[host].read_text()[-3000:]
                st = lab.call(host, [*cli, "node", "status", "--json", "--data-dir", str(d)], check=False, timeout=30)
                if st.returncode == 0:
                    peers[host] = {p["peer_id"]: p["connection"] for p in json.loads(st.stdout)["peers"]}
            if all(len(p) == 2 for p in peers.values()) and len(peers) == 2:
                break
            time.sleep(1.0)  # sleep: poll interval
        else:
            pytest.fail(f"the two nodes never saw each other: {peers}\n{logs['m1'].read_text()[-3000:]}")
        # each lists itself and the other, reached directly over the LAN
        assert sorted(peers["m0"].values()) == sorted(peers["m1"].values()) == ["direct", "self"]
        assert set(peers["m0"]) == set(peers["m1"])
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
