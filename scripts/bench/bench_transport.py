"""Transport benchmark: 256 MiB of tensors between two processes on loopback, five ways, one run.

    python scripts/bench/bench_transport.py [--mib 256] [--repeats 3] [--no-hivemind]

Each mode runs a receiver and a sender as separate processes; the sender times each transfer
from its first byte to the receiver's acknowledgement, and the median of `--repeats` is reported.
- `tensor_mib_s`: our `TensorStreams` over the direct data plane (AES-256-GCM, digest, protocol);
- `libp2p_stream_mib_s`: the same API forced onto the libp2p-stream fallback (Noise + yamux);
- `raw_tcp_mib_s`: plain trio TCP, the same bytes, no encryption (an upper bound);
- `aead_tcp_mib_s`: plain trio TCP with AES-256-GCM over 1 MiB frames and nothing else — what a
  secure channel in Python can reach; `ratio` = tensor_mib_s / aead_tcp_mib_s (target >= 0.5);
- `hivemind_mib_s`: the same payload over one hivemind `P2P` stream (hivemind's own venv, see
  scripts/bench/hivemind_anchor.py); null with a reason if hivemind cannot run here.
`setup_ms` is libp2p dial + Noise + yamux + data-plane session and TCP handshake (median of 3
fresh peers); `rss_peak_mib` is the receiver's peak RSS in the tensor mode (`rss_base_mib`
before the transfer, so the difference is what receiving cost). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHUNK_MIB = 4
sys.path.insert(0, str(ROOT))


def _payload(mib: int):
    import torch

    n_tensors = 16
    per = (mib << 20) // 4 // n_tensors
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(n_tensors)}


def _payload_like(mib: int):
    import torch

    return {k: torch.empty_like(v) for k, v in _payload(mib).items()}


def _say(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- workers -----------------------------------------------------------------------------------


async def _tensor_receiver(args) -> None:
    import trio

    from meshtrain.transport.host import Host
    from meshtrain.transport.identity import Identity
    from meshtrain.transport.tensor_streams import DataPlaneConfig, TensorStreams

    cfg = DataPlaneConfig(direct=args.mode == "tensor", chunk_bytes=args.chunk_mib << 20)
    async with Host(Identity.generate()) as host, TensorStreams(host, cfg) as ts:
        base = _rss_mib()
        # Receive into one preallocated set of buffers, as collectives and checkpoint loading do.
        into = {k: v.zero_() for k, v in _payload_like(args.mib).items()}
        _say({"addr": host.addrs[0]})
        peer = (await trio.to_thread.run_sync(sys.stdin.readline)).strip()
        async with trio.open_nursery() as nursery:

            async def receive_all() -> None:
                for i in range(args.repeats):
                    await ts.receive(peer, f"bench{i}", into=into)

            nursery.start_soon(receive_all)
            await trio.sleep(0.2)
            _say({"ready": True})  # the sender's clock starts only once we are waiting
        _say({"rss_base_mib": base, "rss_peak_mib": _rss_mib()})
        await trio.sleep(0.5)


async def _tensor_sender(args) -> None:
    import trio

    from meshtrain.transport.host import Host
    from meshtrain.transport.identity import Identity
    from meshtrain.transport.tensor_streams import DataPlaneConfig, TensorStreams

    payload = _payload(args.mib)
    cfg = DataPlaneConfig(direct=args.mode == "tensor", chunk_bytes=args.chunk_mib << 20)
    async with Host(Identity.generate()) as host, TensorStreams(host, cfg) as ts:
        t0 = time.perf_counter()
        peer = await host.connect(args.to)
        path = await ts.prepare(peer)
        setup_ms = (time.perf_counter() - t0) * 1e3
        _say({"peer": host.peer_id})
        await trio.to_thread.run_sync(sys.stdin.readline)  # "go": the receiver is waiting
        rates = []
        for i in range(args.repeats):
            t = time.perf_counter()
            rep = await ts.send(peer, f"bench{i}", payload)
            rates.append(rep.nbytes / 2**20 / (time.perf_counter() - t))
        _say({"mib_s": statistics.median(rates), "runs": rates, "setup_ms": setup_ms, "path": path})


async def _socket_receiver(args) -> None:
    import trio
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    key = bytes(range(32))
    aead = AESGCM(key)
    frame = 1 << 20
    total = args.mib << 20
    dest = bytearray(total)
    ct = bytearray(frame + 16)
    done = trio.Event()

    async def serve(stream: trio.SocketStream) -> None:
        sock = stream.socket
        dview, cview = memoryview(dest), memoryview(ct)
        for _ in range(args.repeats):
            pos, ctr = 0, 0
            while pos < total:
                n = min(frame, total - pos)
                if args.mode == "raw":
                    view, want = dview[pos : pos + n], n
                else:
                    view, want = cview[: n + 16], n + 16
                got = 0
                while got < want:
                    r = await sock.recv_into(view[got:], want - got)
                    if r == 0:
                        return
                    got += r
                if args.mode == "aead":
                    aead.decrypt_into(ctr.to_bytes(12, "big"), cview[: n + 16], None, dview[pos : pos + n])
                    ctr += 1
                pos += n
            await stream.send_all(b"k")
        done.set()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, serve, 0)
        _say({"port": listeners[0].socket.getsockname()[1]})
        await done.wait()
        nursery.cancel_scope.cancel()


async def _socket_sender(args) -> None:
    import trio
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    aead = AESGCM(bytes(range(32)))
    frame = 1 << 20
    total = args.mib << 20
    src = memoryview(os.urandom(total))
    out = bytearray(frame + 16)
    t0 = time.perf_counter()
    stream = await trio.open_tcp_stream("127.0.0.1", int(args.to))
    setup_ms = (time.perf_counter() - t0) * 1e3
    _say({"peer": "socket"})
    rates = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        pos, ctr = 0, 0
        while pos < total:
            n = min(frame, total - pos)
            if args.mode == "raw":
                await stream.send_all(src[pos : pos + n])
            else:
                aead.encrypt_into(ctr.to_bytes(12, "big"), src[pos : pos + n], None, memoryview(out)[: n + 16])
                ctr += 1
                await stream.send_all(memoryview(out)[: n + 16])
            pos += n
        await stream.receive_some(1)
        rates.append(args.mib / (time.perf_counter() - t))
    _say({"mib_s": statistics.median(rates), "runs": rates, "setup_ms": setup_ms})
    await stream.aclose()


def _worker(args) -> None:
    import trio

    fn = {
        ("receiver", True): _tensor_receiver,
        ("sender", True): _tensor_sender,
        ("receiver", False): _socket_receiver,
        ("sender", False): _socket_sender,
    }[(args.worker, args.mode in ("tensor", "libp2p"))]
    trio.run(fn, args)


# -- driver ------------------------------------------------------------------------------------


def _spawn(*argv: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, __file__, *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        cwd=ROOT,
    )


def _line(p: subprocess.Popen) -> dict:
    line = p.stdout.readline()
    if not line:
        raise RuntimeError(f"worker exited with {p.wait()}")
    return json.loads(line)


def run_mode(mode: str, mib: int, repeats: int) -> dict:
    common = ["--mode", mode, "--mib", str(mib), "--repeats", str(repeats), "--chunk-mib", str(CHUNK_MIB)]
    rx = _spawn("--worker", "receiver", *common)
    tx = None
    try:
        first = _line(rx)
        target = first.get("addr") or str(first["port"])
        tx = _spawn("--worker", "sender", "--to", target, *common)
        peer = _line(tx)["peer"]
        rx.stdin.write(peer + "\n")
        rx.stdin.flush()
        if mode in ("tensor", "libp2p"):
            _line(rx)  # ready
            tx.stdin.write("go\n")
            tx.stdin.flush()
        result = _line(tx)
        if mode in ("tensor", "libp2p"):
            result.update(_line(rx))
        return result
    finally:
        for p in (tx, rx):
            if p is not None:
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()


def hivemind_rate(mib: int) -> tuple[float | None, str | None]:
    try:
        from scripts.bench.hivemind_anchor import run_probe
    except Exception as e:  # the harness is optional; say why it is missing
        return None, f"hivemind harness unavailable: {e}"
    out = run_probe("hivemind_probe_transport.py", ["--mib", str(mib)], timeout=900)
    if "error" in out:
        return None, out["error"]
    return out.get("hivemind_mib_s"), None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-hivemind", action="store_true")
    p.add_argument("--chunk-mib", type=int, default=4, help="data-plane frame size (1-4 MiB)")
    p.add_argument("--worker", choices=["receiver", "sender"], help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=["tensor", "libp2p", "raw", "aead"], default="tensor", help=argparse.SUPPRESS)
    p.add_argument("--to", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _worker(args)
        return

    global CHUNK_MIB
    CHUNK_MIB = args.chunk_mib
    results = {}
    for mode in ("raw", "aead", "tensor", "libp2p"):
        print(f"[bench_transport] {mode}: {args.mib} MiB x {args.repeats} ...", file=sys.stderr, flush=True)
        results[mode] = run_mode(mode, args.mib, 1 if mode == "libp2p" else args.repeats)
        print(f"[bench_transport] {mode}: {results[mode]['mib_s']:.0f} MiB/s", file=sys.stderr, flush=True)
    setups = [results["tensor"]["setup_ms"]]
    for _ in range(2):
        setups.append(run_mode("tensor", 1, 1)["setup_ms"])
    if args.no_hivemind:
        hm, why = None, "skipped (--no-hivemind)"
    else:
        print("[bench_transport] hivemind (own venv) ...", file=sys.stderr, flush=True)
        hm, why = hivemind_rate(args.mib)
    tensor = results["tensor"]["mib_s"]
    out = {
        "mib": args.mib,
        "tensor_mib_s": round(tensor, 1),
        "libp2p_stream_mib_s": round(results["libp2p"]["mib_s"], 1),
        "raw_tcp_mib_s": round(results["raw"]["mib_s"], 1),
        "aead_tcp_mib_s": round(results["aead"]["mib_s"], 1),
        "ratio": round(tensor / results["aead"]["mib_s"], 3),
        "hivemind_mib_s": None if hm is None else round(hm, 1),
        "hivemind_reason": why,
        "tensor_vs_hivemind": None if not hm else round(tensor / hm, 2),
        "setup_ms": round(statistics.median(setups), 1),
        "rss_base_mib": round(results["tensor"]["rss_base_mib"], 1),
        "rss_peak_mib": round(results["tensor"]["rss_peak_mib"], 1),
        "tensor_runs_mib_s": [round(r, 1) for r in results["tensor"]["runs"]],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
