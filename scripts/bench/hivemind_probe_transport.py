"""hivemind's stream throughput between two processes (runs in hivemind's venv; see scripts/bench/hivemind_anchor.py).

    .venv-hivemind/bin/python scripts/bench/hivemind_probe_transport.py --mib 256 [--repeats 3]

What it measures: how fast N MiB move from one `hivemind.P2P` instance to another, each in its own
process with its own Go `p2pd`, on loopback only (host_maddrs /ip4/127.0.0.1/tcp/0; no relay, no
auto-relay, no AutoNAT, no UPnP/NAT-PMP, no IPFS bootstrap — nothing is dialled but the receiver).

How: hivemind's fastest stream path is the *binary* stream API — `add_binary_stream_handler` /
`call_binary_stream_handler` hand each side a raw asyncio socket to its daemon, which relays the
bytes over libp2p (TCP + TLS 1.3/Noise + yamux) with no protobuf framing and no 4 MiB message cap;
the protobuf handlers (what `DecentralizedAverager` uses) add serialisation and per-message
overhead on top of the same path, so this number is generous to hivemind. The payload is the raw
bytes of fp32 tensors (random, N MiB) written in 1 MiB slices; the receiver reads until it has
N MiB and answers one byte. The sender connects first (daemon to daemon dial + handshake + first
stream open = `setup_ms`, after both daemons are up; `daemon_start_ms` is spawning the sender's
p2pd), then times `--repeats` transfers over that one stream, each from its first byte to the ack.

The last stdout line is one JSON object: {"hivemind_mib_s": median of the repeats (as
scripts/bench/bench_transport.py reports its own modes), "mean_mib_s", "best_mib_s", "runs_mib_s",
"mib", "method", "setup_ms", "daemon_start_ms", "wall_s"} or {"error": ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hivemind_anchor import kill_tree  # noqa: E402  (stdlib only)

CHUNK = 1 << 20
PROTOCOL = "meshtrain-bench"
# everything that could make p2pd reach beyond loopback is off
P2P_KWARGS = dict(
    host_maddrs=["/ip4/127.0.0.1/tcp/0"],
    use_relay=False,
    use_auto_relay=False,
    auto_nat=False,
    nat_port_map=False,
    use_ipfs=False,
    idle_timeout=60,
)


async def receiver(mib: int, repeats: int) -> None:
    from hivemind.p2p import P2P

    p2p = await P2P.create(**P2P_KWARGS)
    done = asyncio.get_running_loop().create_future()

    async def handler(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for _ in range(repeats):
                left = mib << 20
                while left:
                    chunk = await reader.read(min(CHUNK, left))
                    if not chunk:
                        raise ConnectionError(f"stream closed with {left} bytes to go")
                    left -= len(chunk)
                writer.write(b"k")
                await writer.drain()
            if not done.done():
                done.set_result(None)
        except Exception as e:
            if not done.done():
                done.set_exception(e)

    await p2p.add_binary_stream_handler(PROTOCOL, handler)
    maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
    print(json.dumps({"peer_id": p2p.peer_id.to_base58(), "maddrs": maddrs}), flush=True)
    try:
        await done
        await asyncio.sleep(0.5)  # let the ack leave before the daemon goes
    finally:
        await p2p.shutdown()


async def sender(peer_id: str, maddrs: list[str], mib: int, repeats: int) -> None:
    import numpy as np
    from hivemind.p2p import P2P, PeerID
    from hivemind.utils.multiaddr import Multiaddr

    payload = np.random.default_rng(0).standard_normal((mib << 20) // 4, dtype=np.float32)
    view = memoryview(payload).cast("B")
    t0 = time.perf_counter()
    p2p = await P2P.create(**P2P_KWARGS)
    daemon_ms = (time.perf_counter() - t0) * 1e3
    peer = PeerID.from_base58(peer_id)
    t0 = time.perf_counter()
    # dial + security handshake + muxer (hivemind's Multiaddr cannot encode a /p2p/ part for p2pd: strip it)
    await p2p._client.connect(peer, [Multiaddr(m.split("/p2p/")[0]) for m in maddrs])
    _, reader, writer = await p2p.call_binary_stream_handler(peer, PROTOCOL)
    setup_ms = (time.perf_counter() - t0) * 1e3
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        for off in range(0, len(view), CHUNK):
            writer.write(view[off : off + CHUNK])
            await writer.drain()
        await reader.readexactly(1)
        rates.append(mib / (time.perf_counter() - t))
    writer.close()
    await p2p.shutdown()
    print(
        json.dumps(
            {
                "hivemind_mib_s": round(statistics.median(rates), 1),
                "mean_mib_s": round(statistics.fmean(rates), 1),
                "best_mib_s": round(max(rates), 1),
                "runs_mib_s": [round(r, 1) for r in rates],
                "mib": mib,
                "method": f"P2P binary stream (call_binary_stream_handler), raw fp32 tensor bytes in 1 MiB writes, "
                f"one stream, median of {repeats}",
                "setup_ms": round(setup_ms, 1),
                "daemon_start_ms": round(daemon_ms, 1),
            }
        ),
        flush=True,
    )


def _last_json(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600, help="wall-clock limit for the whole probe (s)")
    p.add_argument("--role", choices=["receiver", "sender"], help=argparse.SUPPRESS)
    p.add_argument("--peer", help=argparse.SUPPRESS)
    p.add_argument("--maddrs", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.role == "receiver":
        asyncio.run(receiver(a.mib, a.repeats))
        return
    if a.role == "sender":
        asyncio.run(sender(a.peer, json.loads(a.maddrs), a.mib, a.repeats))
        return

    t_start = time.perf_counter()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup below
    base = [sys.executable, os.path.abspath(__file__), "--mib", str(a.mib), "--repeats", str(a.repeats)]
    procs: list[subprocess.Popen] = []
    result: dict
    try:
        rx_err = tempfile.TemporaryFile("w+")  # noqa: SIM115  (an unread stderr pipe could stall the receiver)
        rx = subprocess.Popen([*base, "--role", "receiver"], stdout=subprocess.PIPE, stderr=rx_err, text=True)
        procs.append(rx)
        hello = _last_json(rx.stdout.readline())  # blocks until the receiver's daemon is up
        if not hello:
            kill_tree(rx.pid)
            rx.wait()
            rx_err.seek(0)
            err = [x for x in rx_err.read().splitlines() if x.strip()]
            raise RuntimeError(f"receiver did not start: {err[-1] if err else 'no output'}")
        tx = subprocess.Popen(
            [*base, "--role", "sender", "--peer", hello["peer_id"], "--maddrs", json.dumps(hello["maddrs"])],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        procs.append(tx)
        left = a.timeout - (time.perf_counter() - t_start)
        try:
            out, err = tx.communicate(timeout=max(left, 1))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"sender did not finish within {a.timeout:g} s") from None
        result = _last_json(out) or {}
        if "hivemind_mib_s" not in result:
            errs = [x for x in err.splitlines() if x.strip()]
            raise RuntimeError(f"sender exited {tx.returncode}: {errs[-1] if errs else 'no output'}")
        with contextlib.suppress(subprocess.TimeoutExpired):
            rx.wait(timeout=15)
        result["wall_s"] = round(time.perf_counter() - t_start, 1)
    except Exception as e:
        result = {"error": " ".join(f"{type(e).__name__}: {e}".split())[:300], "mib": a.mib}
    finally:
        for proc in procs:  # the workers and their p2pd daemons
            if proc.poll() is None:
                kill_tree(proc.pid)
                proc.wait()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
