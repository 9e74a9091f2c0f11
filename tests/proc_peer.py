"""A real peer in its own process, for transport tests that kill, stop or time a peer.

    python tests/proc_peer.py receiver --mib 64 [--direct 0]
        prints {"peer": id, "addr": multiaddr}; reads the sender's peer id from stdin;
        receives tag "payload"; prints {"ok": digest-hex, "path": ...} or {"error": ...}
    python tests/proc_peer.py sender --to ADDR --mib 64 [--direct 0]
        prints {"peer": id}; waits for "go" on stdin; prints {"sending": true} when it starts;
        sends; prints the same kind of result.

    python tests/proc_peer.py silent --key DATA_DIR/identity.key
        a host with that identity that answers connections and says nothing else (no DHT, no
        swarm records): prints {"peer": id, "addr": multiaddr}; runs until stdin closes.

The payload is deterministic (seeded), so both sides can compare digests.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import trio

from meshtrain.transport.host import Host
from meshtrain.transport.identity import Identity
from meshtrain.transport.tensor_streams import DataPlaneConfig, TensorStreams


def payload(mib: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    n = (mib << 20) // 4
    parts = max(1, min(8, mib // 8))
    return {f"t{i}": torch.randn(n // parts, generator=g) for i in range(parts)}


def say(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


async def silent(key: str) -> None:
    async with Host(Identity.load(key)) as host:
        say({"peer": host.peer_id, "addr": host.addrs[0]})
        await trio.to_thread.run_sync(sys.stdin.read)


async def main(args: argparse.Namespace) -> None:
    if args.role == "silent":
        await silent(args.key)
        return
    cfg = DataPlaneConfig(direct=bool(args.direct), resume_window=args.resume_window)
    async with Host(Identity.generate()) as host, TensorStreams(host, cfg) as ts:
        if args.role == "receiver":
            say({"peer": host.peer_id, "addr": host.addrs[0]})
            sender = (await trio.to_thread.run_sync(sys.stdin.readline)).strip()
            try:
                r = await ts.receive(sender, "payload", timeout=args.timeout)
                say({"ok": r.digest.hex(), "path": r.path, "nbytes": r.nbytes})
            except Exception as e:
                say({"error": type(e).__name__, "text": str(e)})
        else:
            peer = await host.connect(args.to)
            say({"peer": host.peer_id})
            await trio.to_thread.run_sync(sys.stdin.readline)
            tensors = payload(args.mib)
            say({"sending": True})
            try:
                rep = await ts.send(peer, "payload", tensors, timeout=args.timeout)
                say({"ok": rep.digest.hex(), "path": rep.path, "resumes": rep.resumes})
            except Exception as e:
                say({"error": type(e).__name__, "text": str(e)})


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["receiver", "sender", "silent"])
    p.add_argument("--to")
    p.add_argument("--key")
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--direct", type=int, default=1)
    p.add_argument("--timeout", type=float, default=120)
    p.add_argument("--resume-window", type=float, default=5)
    trio.run(main, p.parse_args())
    # Exit without the interpreter's teardown: with torch and libp2p loaded it costs up to a
    # second of CPU per process (more on a busy machine) while the harness waits for our exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
