"""A meshtrain peer with the whole NAT traversal stack, run inside a NAT-lab namespace.

    ip netns exec <ns> python tests/proc_nat_peer.py --listen 10.1.0.10 [--listen 2001:db8:1::10] [--serve-relay]
        [--relay-json '{"circuit_bytes": 1048576}'] [--no-data-plane]

It prints {"ready": true, "peer": id, "addrs": [...]} and then reads one JSON command per line on
stdin; each runs in its own task (so a `recv` can wait while a `send` runs) and answers with one
JSON line carrying the same "id": {"id": 3, "ok": true, ...} or {"id": 3, "ok": false, "error":
"...", "type": "ExceptionName"}. Commands (fields besides "cmd" and "id"):

    info                                   peer id, addrs, circuit addrs, reachability
    connect      addr                      connect (direct or circuit address); "type" of the result
    probe        [servers]                 reachability probe
    reserve      relay                     one reservation; keep: relays -> keep_reserved
    reservations                           held reservations (with refresh counts)
    upgrade      peer [timeout]            DCUtR; "direct" and "seconds"
    conn_type    peer                      "direct" | "relayed" | null
    send         peer tag mib [timeout]    tensors over the data plane; "path", "digest"
    recv         peer tag [timeout]        the matching receive
    allreduce    peers round mib [stripe_bytes] [uplink_mbit]  one SwarmCollective.all_reduce of
                                           seeded tensors (uplink_mbit: our configured link rate
                                           from now on, 0: measured); "uplink_measured_mbit",
                                           "paths" (libp2p), "data_paths" (our tensors')
    relay_stats                            the relay's counters (bytes relayed, limit resets)
    lan                                    peers heard over mDNS (--mdns SWARM) and our link to each
    upnp         [deadline]                map our libp2p and data-plane ports on the LAN's gateway
    quit

Used by tests/test_nat_*.py and scripts/bench/bench_nat.py; it exists because a namespace holds a
process, not a trio task.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import AsyncExitStack
from typing import Any

import torch
import trio

from meshtrain.dht.mdns import LanDiscovery
from meshtrain.log import configure
from meshtrain.transport.holepunch import HolePunchService
from meshtrain.transport.host import Host, HostConfig
from meshtrain.transport.identity import Identity
from meshtrain.transport.reachability import ReachabilityConfig, ReachabilityService
from meshtrain.transport.relay import RelayConfig, RelayService
from meshtrain.transport.tensor_streams import DataPlaneConfig, TensorStreams
from meshtrain.transport.upnp import PortMapper


def payload(mib: float, seed: int = 1234) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = max(1, int(mib * (1 << 20)) // 4)
    return {"w": torch.randn(n, generator=g)}


def say(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


class Peer:
    def __init__(
        self,
        host: Host,
        ts: TensorStreams | None,
        reach: ReachabilityService,
        relay: RelayService,
        punch: HolePunchService,
    ) -> None:
        self.host, self.ts, self.reach, self.relay, self.punch = host, ts, reach, relay, punch
        self.collective: Any = None
        self.lan: Any = None

    async def run(self, cmd: dict) -> dict:
        op = cmd["cmd"]
        h = self.host
        if op == "info":
            return {
                "peer": h.peer_id,
                "addrs": h.addrs,
                "circuits": self.relay.circuit_addrs,
                "reachability": self.reach.status,
                "observed_ip": self.reach.observed_ip,
            }
        if op == "connect":
            t0 = time.monotonic()
            peer = await h.connect(cmd["addr"], timeout=cmd.get("timeout", 20))
            return {"peer": peer, "type": h.connection_type(peer), "seconds": time.monotonic() - t0}
        if op == "probe":
            r = await self.reach.probe(cmd.get("servers"))
            return {
                "status": r.status,
                "observed_ip": r.observed_ip,
                "public_addrs": list(r.public_addrs),
                "errors": list(r.errors),
                "answers": len(r.answers),
            }
        if op == "reserve":
            r = await self.relay.reserve(cmd["relay"])
            return {
                "circuits": list(r.circuit_addrs),
                "expires_in": r.expires_at - time.time(),
                "circuit_duration": r.circuit_duration,
                "circuit_bytes": r.circuit_bytes,
                "refreshes": r.refreshes,
            }
        if op == "keep":
            relays = list(cmd["relays"])
            self.relay.keep_reserved(lambda: relays)
            return {}
        if op == "reservations":
            return {
                "reservations": [
                    {
                        "relay": r.relay,
                        "refreshes": r.refreshes,
                        "expires_in": r.expires_at - time.time(),
                        "circuits": list(r.circuit_addrs),
                    }
                    for r in self.relay.reservations.values()
                ]
            }
        if op == "upgrade":
            t0 = time.monotonic()
            ok = await self.punch.upgrade(cmd["peer"], cmd.get("timeout"))
            return {"direct": ok, "seconds": time.monotonic() - t0}
        if op == "conn_type":
            return {"type": h.connection_type(cmd["peer"])}
        if op == "send":
            assert self.ts is not None  # test harness misuse
            t0 = time.monotonic()
            rep = await self.ts.send(
                cmd["peer"], cmd["tag"], payload(cmd["mib"], cmd.get("seed", 1)), timeout=cmd.get("timeout", 60)
            )
            return {
                "path": rep.path,
                "digest": rep.digest.hex(),
                "nbytes": rep.nbytes,
                "seconds": time.monotonic() - t0,
            }
        if op == "recv":
            assert self.ts is not None
            r = await self.ts.receive(cmd["peer"], cmd["tag"], timeout=cmd.get("timeout", 60))
            return {"path": r.path, "digest": r.digest.hex(), "nbytes": r.nbytes}
        if op == "allreduce":
            return await self._allreduce(cmd)
        if op == "lan":
            found = self.lan.found if self.lan is not None else {}
            return {"peers": {p: {"addrs": a, "type": h.connection_type(p)} for p, a in found.items()}}
        if op == "upnp":
            ports = [int(h.addrs[0].split("/tcp/")[1].split("/")[0])]
            if self.ts is not None and self.ts.port:
                ports.append(self.ts.port)
            t0 = time.monotonic()
            async with PortMapper(ports, discover_timeout=cmd.get("deadline", 5.0)) as m:
                r = m.result
            return {
                "gateway": r.gateway,
                "mapped": list(r.mapped_ports),
                "error": r.error,
                "external_ip": r.external_ip,
                "seconds": time.monotonic() - t0,
            }
        if op == "relay_stats":
            return {"stats": dict(self.relay.protocol.stats)}
        raise ValueError(f"unknown command {op!r}")

    async def _allreduce(self, cmd: dict) -> dict:
        from meshtrain.collective.allreduce import AllReduceConfig, SwarmCollective
        from meshtrain.collective.contract import RoundRequest

        assert self.ts is not None
        peers = list(cmd["peers"])
        if self.collective is None:
            self.collective = SwarmCollective(
                self.host,
                self.ts,
                lambda _r: peers,
                AllReduceConfig(
                    join_timeout=60, part_timeout=60, min_bandwidth=1e6, stripe_bytes=cmd.get("stripe_bytes", 2 << 20)
                ),
            )
        if "uplink_mbit" in cmd:
            self.collective.uplink_mbit = float(cmd["uplink_mbit"])
        mine = payload(cmd["mib"], seed=sorted(peers).index(self.host.peer_id) + 7)
        t0 = time.monotonic()
        res = await self.collective.all_reduce(RoundRequest(mine, round_id=cmd["round"], tag="nat"))
        t1 = time.monotonic()
        measured = self.collective.measured_uplink
        return {
            "seconds": t1 - t0,
            "started": t0,  # this machine's monotonic clock, shared by every lab namespace
            "ended": t1,
            "uplink_measured_mbit": None if measured is None else round(measured * 8 / 1e6, 1),
            "digest": res.digest.hex(),
            "contributors": list(res.contributors),
            "excluded": dict(res.excluded),
            "paths": {p: self.host.connection_type(p) for p in peers if p != self.host.peer_id},
            # how our tensors went to each: the path of the newest data-plane connection we opened
            "data_paths": {p: self.ts.paths.get(p) for p in peers if p != self.host.peer_id},
        }


async def main(args: argparse.Namespace) -> None:
    configure(args.log)
    relay_cfg = RelayConfig(serve=args.serve_relay, **json.loads(args.relay_json or "{}"))
    listen = [f"/{'ip6' if ':' in ip else 'ip4'}/{ip}/tcp/{args.port}" for ip in args.listen]
    async with AsyncExitStack() as stack:
        host = await stack.enter_async_context(Host(Identity.generate(), HostConfig(listen=listen)))
        ts = None
        if args.data_plane:
            ts = await stack.enter_async_context(TensorStreams(host, DataPlaneConfig()))
        reach = await stack.enter_async_context(ReachabilityService(host, config=ReachabilityConfig(probe_interval=0)))
        relay = await stack.enter_async_context(RelayService(host, relay_cfg))
        punch = await stack.enter_async_context(HolePunchService(host, reach, ts))
        peer = Peer(host, ts, reach, relay, punch)
        if args.mdns:

            async def dial(pid: str, addrs: list[str]) -> None:
                await host.connect(f"{addrs[0]}/p2p/{pid}", timeout=5)

            peer.lan = await stack.enter_async_context(LanDiscovery(host, args.mdns, dial))
        say({"ready": True, "peer": host.peer_id, "addrs": host.addrs})

        async def handle(cmd: dict) -> None:
            try:
                out = await peer.run(cmd)
                say({"id": cmd.get("id"), "ok": True, **out})
            except Exception as e:
                say({"id": cmd.get("id"), "ok": False, "type": type(e).__name__, "error": str(e)})

        async with trio.open_nursery() as nursery:
            while True:
                line = await trio.to_thread.run_sync(sys.stdin.readline)
                if not line or line.strip() == "":
                    if not line:
                        break
                    continue
                cmd = json.loads(line)
                if cmd.get("cmd") == "quit":
                    break
                nursery.start_soon(handle, cmd)
            nursery.cancel_scope.cancel()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--listen", required=True, action="append", help="an IPv4 or IPv6 address; twice: dual stack")
    p.add_argument("--port", type=int, default=4001)
    p.add_argument("--serve-relay", action="store_true")
    p.add_argument("--relay-json", default="")
    p.add_argument("--no-data-plane", dest="data_plane", action="store_false")
    p.add_argument("--mdns", default="", help="LAN discovery (mDNS) for this swarm id")
    p.add_argument("--log", default="WARNING")
    trio.run(main, p.parse_args())
    # Exit without the interpreter's teardown: with torch and libp2p loaded it costs up to a
    # second of CPU per process (more on a busy machine) while the harness waits for our exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
