"""The whole system behind NATs: real `meshtrain node` daemons, one public and three
private — two behind cone NATs, one behind a symmetric NAT — started with the commands of
docs/guide.md ("Joining a swarm from two machines") and the default configuration, nothing wired by hand. The
swarm trains through several rounds, survives one daemon being killed, and every node's status
shows how it is connected: its own reachability, and per peer "direct" or "relayed".

What the NATs make of it (scripts/labs/natlab): the public node is reachable; the private ones learn
they are private from its dial-backs, reserve a relay slot on it and announce circuit addresses;
the cone pair punches a direct path (DCUtR), which the test waits for; the symmetric peer cannot
punch through to a cone peer (its mapping changes per destination), so that pair stays relayed, and its tensors move over
the relayed libp2p stream (the data plane's fallback).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import require_natlab

pytestmark = [pytest.mark.nat, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
HOSTS = ("pub0", "h0", "h1", "h2")  # public, cone, cone, symmetric
KILLED = "h1"


def meshtrain(*args: str) -> list[str]:
    return [sys.executable, "-m", "meshtrain.node.cli", *args]


def node_status(lab, host: str, data_dir: Path) -> dict | None:
    """`meshtrain node status --json`, run where the node runs (its status port is on that
    namespace's loopback); None while it does not answer."""
    r = lab.call(host, meshtrain("node", "status", "--data-dir", str(data_dir), "--json"), timeout=30, check=False)
    if r.returncode != 0:
        return None
    try:
        return json.loads(r.stdout)
    except ValueError:
        return None


def create_swarm(data_dir: Path, env: dict[str, str], *flags: str) -> None:
    """`meshtrain swarm create` of a gpt-tiny swarm that runs until stopped, in `data_dir`."""
    made = subprocess.run(
        meshtrain("swarm", "create", "--data-dir", str(data_dir), "--model", "gpt-tiny", "--steps", "0", *flags),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr


def wait_for(what: str, check, timeout: float, logs: dict[str, Path]):
    """Poll `check()` until it returns something truthy; fail with every node's log tail."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(1.0)  # sleep: poll interval
    tails = "\n".join(f"--- {h}\n{p.read_text()[-2500:]}" for h, p in logs.items() if p.exists())
    raise AssertionError(f"timed out waiting for {what}\n{tails}")


@pytest.mark.timeout(600)
def test_daemons_behind_cone_and_symmetric_nats_train_and_survive_a_killed_peer(tmp_path):
    require_natlab()
    from scripts.labs.natlab.lab import NatLab

    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    dirs = {h: tmp_path / h for h in HOSTS}
    logs = {h: tmp_path / f"{h}.log" for h in HOSTS}
    procs: dict[str, subprocess.Popen] = {}
    with NatLab(["cone", "cone", "symmetric"], public_hosts=1) as lab:
        public_ip = lab.public_addr("pub0")
        # Machine A, reachable at its public address: create the swarm and run it.
        create_swarm(dirs["pub0"], env, "--H", "10")
        start = ["node", "start", "--data-dir", str(dirs["pub0"]), "--listen", "/ip4/0.0.0.0/tcp/4001"]
        start += ["--announce", f"/ip4/{public_ip}/tcp/4001"]
        with open(logs["pub0"], "w") as err:
            procs["pub0"] = lab.run("pub0", meshtrain(*start), stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT, env=env)
        info = wait_for(
            "the public node's daemon.json", lambda: daemon_json(dirs["pub0"], procs["pub0"], logs["pub0"]), 90, logs
        )
        address = f"/ip4/{public_ip}/tcp/4001/p2p/{info['peer_id']}"
        # The others, each behind its home's NAT: one command.
        for h in HOSTS[1:]:
            with open(logs[h], "w") as err:
                join = meshtrain("swarm", "join", address, "--data-dir", str(dirs[h]))
                procs[h] = lab.run(h, join, stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT, env=env)

        def statuses(hosts) -> dict[str, dict] | None:
            out = {}
            for h in hosts:
                assert procs[h].poll() is None, f"{h} exited with {procs[h].returncode}:\n{logs[h].read_text()[-3000:]}"
                st = node_status(lab, h, dirs[h])
                if st is None:
                    return None
                out[h] = st
            return out

        def together(hosts, after: dict[str, int] | None = None, rounds: int = 0):
            """Every node of `hosts` sees exactly them live, has rounded `rounds` times past
            `after`, its φ check agrees with all of them (parity `ok`, agreeing = len(hosts)) and,
            past `after`, one of its newest rounds (`round_peers`) was theirs all: the same φ alone
            is not enough (under load, the NAT peers once never met in a round and each
            downloaded the public node's state every round, so their φ agreed)."""

            def check():
                st = statuses(hosts)
                if not st:
                    return None
                for h, s in st.items():
                    live = {p["peer_id"] for p in s["peers"]}
                    parity = s["training"]["parity"] or {}
                    if len(live) != len(hosts) or (after and s["training"]["round"] < after[h] + rounds):
                        return None
                    if parity.get("status") != "ok" or parity.get("agreeing") != len(hosts):
                        return None
                    if after and not any(len(peers) == len(hosts) for _, peers in s["training"]["round_peers"]):
                        return None
                return st

            return check

        # Every node trains, and all four hold the same φ round after round.
        st = wait_for("four nodes agreeing on φ", together(HOSTS), 300, logs)
        first = {h: s["training"]["round"] for h, s in st.items()}
        st = wait_for("five more rounds of the four", together(HOSTS, first, 5), 300, logs)
        ids = {h: s["node"]["peer_id"] for h, s in st.items()}
        name = {v: k for k, v in ids.items()}
        expected = {"pub0": "public", "h0": "relayed", "h1": "relayed", "h2": "relayed"}

        def announced_everywhere():
            """Every node holds every peer's announced reachability: a node announces it in its
            membership record at its next heartbeat after probing, so the others' views lag its
            own status by up to a heartbeat and a gossip round (CI: pub0 still held h1's
            "unknown" while h1's own status said "relayed")."""
            got = statuses(HOSTS)
            if got and all(
                {name[p["peer_id"]]: p["reachability"] for p in s["peers"]} == expected for s in got.values()
            ):
                return got
            return None

        st = wait_for("every node to see the others' announced reachability", announced_everywhere, 60, logs)
        # How each node is connected, as its status shows it.
        assert st["pub0"]["node"]["reachability"] == "public"
        for h in HOSTS[1:]:
            assert st[h]["node"]["reachability"] == "relayed", (h, st[h]["node"]["reachability"])
        for h, s in st.items():
            seen = {name[p["peer_id"]]: p["connection"] for p in s["peers"]}
            announced = {name[p["peer_id"]]: p["reachability"] for p in s["peers"]}
            assert seen[h] == "self" and set(seen.values()) <= {"self", "direct", "relayed", "none"}, (h, seen)
            assert announced == expected, (h, announced)
            # Everyone dials the public node straight; it never needs a relay to them either.
            assert seen["pub0" if h != "pub0" else "h0"] == "direct", (h, seen)
        # A symmetric NAT maps every destination to a new port: no hole punch reaches a cone peer.
        to_cone = {name[p["peer_id"]]: p["connection"] for p in st["h2"]["peers"]}
        assert "direct" not in (to_cone["h0"], to_cone["h1"]), to_cone

        # The cone pair punches through (DCUtR, at once after a relayed dial and retried while
        # relayed): each of the two sees the other "direct", with nothing but the defaults.
        def cone_pair_direct() -> bool:
            st = statuses(("h0", "h1"))
            if not st:
                return False
            seen = {h: {name.get(p["peer_id"]): p["connection"] for p in s["peers"]} for h, s in st.items()}
            return seen["h0"].get("h1") == "direct" and seen["h1"].get("h0") == "direct"

        wait_for("the cone pair to punch a direct connection", cone_pair_direct, 120, logs)

        # Kill a private peer outright; the others go on, and agree, without it.
        procs[KILLED].send_signal(signal.SIGKILL)
        procs[KILLED].wait(timeout=30)
        survivors = [h for h in HOSTS if h != KILLED]
        at_kill = {h: st[h]["training"]["round"] for h in survivors}
        st = wait_for("five rounds of the three survivors", together(survivors, at_kill, 5), 300, logs)
        for h in survivors:
            procs[h].send_signal(signal.SIGINT)
        for h in survivors:
            try:
                procs[h].wait(timeout=60)
            except subprocess.TimeoutExpired:
                procs[h].kill()


def daemon_json(data_dir: Path, proc: subprocess.Popen, log: Path) -> dict | None:
    assert proc.poll() is None, f"the node exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
    try:
        return json.loads((data_dir / "daemon.json").read_text())
    except (OSError, ValueError):
        return None
