"""`--data-port` behind a firewall that opens only the two ports a node announces: tensors go direct.

A cloud VM or a home port forward opens the ports it is told to, no others. The data plane used
to listen on a random port nothing opened, so such a node moved its bulk tensors over the slow
libp2p fallback. In the NAT lab (scripts/labs/natlab, as root) three public hosts each get an nft
input filter that accepts replies, loopback and ICMP, and new TCP connections only to the ports
listed for it:
- pub0 and pub1 open 4001 (libp2p) and 4002, and run with `--data-port 4002`: each one's status
  says its tensors to the other went direct (`data_path`), and no log says otherwise;
- pub2 opens only 4001 and runs with the default data port (any free one): the control. The
  firewall drops the others' dials to its data plane, so their tensors to it go over libp2p, and
  `node status` says so — what the first two would have said without the flag.
All three train together and hold one φ: the fallback is slower, never wrong.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from .conftest import require_natlab
from .test_nat_swarm import create_swarm, daemon_json, meshtrain, node_status, wait_for

pytestmark = [pytest.mark.nat, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
HOSTS = ("pub0", "pub1", "pub2")
OPEN = {"pub0": "4001, 4002", "pub1": "4001, 4002", "pub2": "4001"}


def firewall(ports: str) -> str:
    return f"""
table inet meshtrain_fw {{
    chain input {{
        type filter hook input priority 0; policy drop;
        ct state established,related accept
        iif "lo" accept
        ip protocol icmp accept
        tcp dport {{ {ports} }} accept
    }}
}}
"""


@pytest.mark.timeout(420)
def test_data_port_through_a_firewall_goes_direct_and_a_closed_one_falls_back(tmp_path):
    require_natlab()
    from scripts.labs.natlab.lab import NatLab

    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MESHTRAIN_LOG_LEVEL="INFO")
    dirs = {h: tmp_path / h for h in HOSTS}
    logs = {h: tmp_path / f"{h}.log" for h in HOSTS}
    procs: dict[str, subprocess.Popen] = {}
    with NatLab([], public_hosts=len(HOSTS)) as lab:
        for h in HOSTS:
            lab.call(h, ["nft", "-f", "-"], input=firewall(OPEN[h]))
        create_swarm(dirs["pub0"], env, "--H", "5")
        ip0 = lab.public_addr("pub0")
        start = ["node", "start", "--data-dir", str(dirs["pub0"]), "--listen", "/ip4/0.0.0.0/tcp/4001"]
        start += ["--announce", f"/ip4/{ip0}/tcp/4001", "--data-port", "4002", "--wait-peers", "3"]
        with open(logs["pub0"], "w") as err:
            procs["pub0"] = lab.run("pub0", meshtrain(*start), stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT, env=env)
        try:
            info = wait_for(
                "pub0's daemon.json", lambda: daemon_json(dirs["pub0"], procs["pub0"], logs["pub0"]), 90, logs
            )
            address = f"/ip4/{ip0}/tcp/4001/p2p/{info['peer_id']}"
            for h in HOSTS[1:]:
                join = ["swarm", "join", address, "--data-dir", str(dirs[h]), "--wait-peers", "3"]
                join += ["--announce", f"/ip4/{lab.public_addr(h)}/tcp/4001"]
                if h != "pub2":
                    join += ["--data-port", "4002"]
                with open(logs[h], "w") as err:
                    procs[h] = lab.run(h, meshtrain(*join), stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT, env=env)

            ids: dict[str, str] = {}

            def paths() -> dict[str, dict[str, str | None]] | None:
                """Every node's data path to each of the others (by host), once all three trained
                two rounds together and hold one φ."""
                out = {}
                for h in HOSTS:
                    assert procs[h].poll() is None, f"{h} exited:\n{logs[h].read_text()[-3000:]}"
                    st = node_status(lab, h, dirs[h])
                    if st is None or st["training"]["round"] < 2:
                        return None
                    parity = st["training"]["parity"] or {}
                    if parity.get("status") != "ok" or parity.get("agreeing") != len(HOSTS):
                        return None
                    ids[h] = st["node"]["peer_id"]
                    out[h] = {p["peer_id"]: p.get("data_path") for p in st["peers"] if p["connection"] != "self"}
                if len(ids) < len(HOSTS):
                    return None
                host_of = {v: k for k, v in ids.items()}
                named = {h: {host_of.get(p, p): path for p, path in seen.items()} for h, seen in out.items()}
                # Every pair has exchanged tensors both ways by now.
                return named if all(None not in seen.values() and len(seen) == 2 for seen in named.values()) else None

            seen = wait_for("three nodes sharing rounds and one φ", paths, 240, logs)
            assert seen["pub0"]["pub1"] == "direct" and seen["pub1"]["pub0"] == "direct", seen
            # The control: pub2's data port is closed to new connections, so tensors *to* it go over
            # libp2p; its own dials to the open data ports go direct.
            assert seen["pub0"]["pub2"] == "libp2p" and seen["pub1"]["pub2"] == "libp2p", seen
            assert seen["pub2"]["pub0"] == "direct" and seen["pub2"]["pub1"] == "direct", seen
            for h in ("pub0", "pub1"):
                fell_back = [ln for ln in logs[h].read_text().splitlines() if "no direct data path" in ln]
                assert all(ids["pub2"] in ln for ln in fell_back), (h, fell_back)
            listed = lab.call("pub0", meshtrain("node", "status", "--data-dir", str(dirs["pub0"])), timeout=30)
            assert any(ids["pub2"][-12:] in ln and "tensors over libp2p" in ln for ln in listed.stdout.splitlines())
            assert not any(ids["pub1"][-12:] in ln and "tensors over libp2p" in ln for ln in listed.stdout.splitlines())
        finally:
            for p in procs.values():
                p.send_signal(signal.SIGINT)
            for p in procs.values():
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
