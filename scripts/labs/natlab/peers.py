"""Drive meshtrain peers (tests/proc_nat_peer.py) running inside lab namespaces (NAT or WAN lab).

A lab host holds processes, not trio tasks, so each peer is a process speaking JSON lines: we
write a command with an id and a reader thread files every answer under its id. Tests and
`scripts/bench/bench_nat.py` use `LabPeer` to connect, reserve, punch and move tensors between peers
that really sit behind the lab's NATs.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from scripts.labs.natlab.lab import NamespaceLab

ROOT = Path(__file__).resolve().parents[3]
PEER_SCRIPT = str(ROOT / "tests" / "proc_nat_peer.py")
READY_TIMEOUT = 60.0  # a peer imports torch and py-libp2p: seconds on a busy 2-core machine


class LabPeerError(RuntimeError):
    """A peer command failed (the message carries the peer's error) or timed out."""


class LabPeer:
    """One meshtrain peer process in a lab host. `call(cmd, **fields)` runs a command and waits.

    serve_relay: relay for others (public hosts). relay: RelayConfig fields as a dict.
    log_path:    where the peer's stderr goes (read it when a test fails).
    mdns:        a swarm id: discover peers of that swarm on the LAN over mDNS.
    ipv6:        False: listen on the host's IPv4 address; True: on its IPv6 address instead
                 (`NatLab(ipv6=True)`), the peer then speaks IPv6 only; "dual": on both.
    """

    def __init__(
        self,
        lab: NamespaceLab,
        host: str,
        *,
        serve_relay: bool = False,
        relay: dict[str, Any] | None = None,
        data_plane: bool = True,
        log_path: str | None = None,
        log_level: str = "INFO",
        port: int = 4001,
        mdns: str = "",
        ipv6: bool | str = False,
        wait: bool = True,
    ) -> None:
        self.lab, self.name = lab, host
        self.first_probe: dict[str, Any] | None = None  # a test's record of an early probe
        self.log_path = log_path or os.devnull
        if ipv6 not in (False, True, "dual"):
            raise ValueError(f"ipv6 must be False, True or 'dual', not {ipv6!r}")
        addr6 = lab.host(host).addr6
        if ipv6 and not addr6:
            raise LabPeerError(f"{host} has no IPv6 address: build the lab with ipv6=True")
        listen = {False: [lab.addr(host)], True: [addr6], "dual": [lab.addr(host), addr6]}[ipv6]
        argv = [sys.executable, PEER_SCRIPT, *(a for ip in listen for a in ("--listen", ip))]
        argv += ["--port", str(port), "--log", log_level]
        if serve_relay:
            argv.append("--serve-relay")
        if relay:
            argv += ["--relay-json", json.dumps(relay)]
        if not data_plane:
            argv.append("--no-data-plane")
        if mdns:
            argv += ["--mdns", mdns]
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
        with open(self.log_path, "a") as err:
            self.proc = lab.run(
                host, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, cwd=str(ROOT), env=env
            )
        self._answers: dict[Any, dict] = {}
        self._cond = threading.Condition()
        self._ids = itertools.count(1)
        self._eof = False
        threading.Thread(target=self._read, daemon=True, name=f"peer-{host}").start()
        self.peer_id = ""
        self.addrs: list[str] = []
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> LabPeer:
        """Wait for the process to print its identity (start several peers, then wait)."""
        if not self.peer_id:
            ready = self._wait("ready", timeout)
            self.peer_id, self.addrs = ready["peer"], ready["addrs"]
        return self

    @property
    def addr(self) -> str:
        return self.addrs[0]

    def addr_in(self, family: str) -> str:
        """Our first address of `family` ("ip4" or "ip6"): a dual-stack peer has one of each,
        in no fixed order."""
        for a in self.addrs:
            if a.startswith(f"/{family}/"):
                return a
        raise LabPeerError(f"peer {self.name} has no /{family}/ address: {self.addrs}")

    def _read(self) -> None:
        assert self.proc.stdout is not None  # we asked for a pipe
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            key = "ready" if msg.get("ready") else msg.get("id")
            with self._cond:
                self._answers[key] = msg
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def _wait(self, key: Any, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        with self._cond:
            while key not in self._answers:
                left = deadline - time.monotonic()
                if self._eof:
                    raise LabPeerError(
                        f"peer {self.name} exited (code {self.proc.poll()}) before answering; its log: {self.log_path}"
                    )
                if left <= 0:
                    raise LabPeerError(
                        f"peer {self.name} did not answer {key!r} within {timeout:g} s; its log: {self.log_path}"
                    )
                self._cond.wait(left)
            return self._answers.pop(key)

    def submit(self, cmd: str, **fields: Any) -> int:
        """Send a command without waiting; `result(id)` collects its answer."""
        cid = next(self._ids)
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, "id": cid, **fields}) + "\n")
        self.proc.stdin.flush()
        return cid

    def result(self, cid: int, timeout: float = 60.0, check: bool = True) -> dict:
        msg = self._wait(cid, timeout)
        if check and not msg.get("ok"):
            raise LabPeerError(f"peer {self.name}: {msg.get('type')}: {msg.get('error')}")
        return msg

    def call(self, cmd: str, *, timeout: float = 60.0, check: bool = True, **fields: Any) -> dict:
        return self.result(self.submit(cmd, **fields), timeout, check)

    def circuit(self, relay: LabPeer, family: str | None = None) -> str:
        """Our address through `relay` (valid once we hold a reservation there); `family`:
        through the relay's address of that family."""
        via = relay.addr_in(family) if family else relay.addr
        return f"{via}/p2p-circuit/p2p/{self.peer_id}"

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.submit("quit")
                self.proc.wait(timeout=5)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                self.proc.kill()


def start_peers(lab: NamespaceLab, specs: dict[str, dict[str, Any]], log_dir: str | None = None) -> dict[str, LabPeer]:
    """Start one peer per lab host (name -> LabPeer keyword options) in parallel, wait for all.

    On failure the peers already started are closed (the lab's teardown kills them anyway)."""
    peers: dict[str, LabPeer] = {}
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
    try:
        for host, opts in specs.items():
            log_path = os.path.join(log_dir, f"{host}.log") if log_dir else None
            peers[host] = LabPeer(lab, host, wait=False, log_path=log_path, **opts)
        for p in peers.values():
            p.wait_ready()
    except BaseException:
        for p in peers.values():
            p.close()
        raise
    return peers
