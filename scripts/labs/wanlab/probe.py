"""Small socket programs the WAN lab runs inside its peers to check its own links.

    python scripts/labs/wanlab/probe.py udp-sink [--count N]        prints {"port"}, then the result
    python scripts/labs/wanlab/probe.py udp-send IP PORT [--count N]
    python scripts/labs/wanlab/probe.py tcp-sink                    prints {"port"}; reads until EOF
    python scripts/labs/wanlab/probe.py tcp-send IP PORT [--seconds S]   prints {"mbit_s"}

UDP probes carry the sender's `time.monotonic_ns()`; every namespace shares the machine's
monotonic clock, so the sink computes each probe's one-way latency directly and prints
{"median", "min", "max", "received"} in ms. tcp-send writes for one second of warm-up (slow
start), then for `--seconds`, and reports the goodput of the timed part from the bytes the kernel
accepted — with a send buffer far smaller than the bytes sent, that is the link's rate.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import struct
import time


def out(**kw: object) -> None:
    print(json.dumps(kw), flush=True)


def udp_sink(count: int) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", 0))
    s.settimeout(10)
    out(port=s.getsockname()[1])
    lat = []
    try:
        while len(lat) < count:
            data, _ = s.recvfrom(64)
            lat.append((time.monotonic_ns() - struct.unpack(">q", data[:8])[0]) / 1e6)
    except TimeoutError:
        pass
    out(
        received=len(lat),
        median=statistics.median(lat) if lat else None,
        min=min(lat, default=None),
        max=max(lat, default=None),
    )


def udp_send(ip: str, port: int, count: int) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for _ in range(count):
        s.sendto(struct.pack(">q", time.monotonic_ns()), (ip, port))
        time.sleep(0.02)


def tcp_sink() -> None:
    srv = socket.socket()
    srv.bind(("0.0.0.0", 0))
    srv.listen(1)
    out(port=srv.getsockname()[1])
    conn, _ = srv.accept()
    while conn.recv(1 << 20):
        pass


def tcp_send(ip: str, port: int, seconds: float) -> None:
    s = socket.create_connection((ip, port), timeout=30)
    buf = b"\0" * (1 << 16)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.0:
        s.sendall(buf)
    sent, t1 = 0, time.monotonic()
    while time.monotonic() - t1 < seconds:
        s.sendall(buf)
        sent += len(buf)
    out(mbit_s=sent * 8 / (time.monotonic() - t1) / 1e6)
    s.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["udp-sink", "udp-send", "tcp-sink", "tcp-send"])
    p.add_argument("ip", nargs="?")
    p.add_argument("port", nargs="?", type=int)
    p.add_argument("--count", type=int, default=20)
    p.add_argument("--seconds", type=float, default=2.0)
    a = p.parse_args()
    if a.role == "udp-sink":
        udp_sink(a.count)
    elif a.role == "udp-send":
        udp_send(a.ip, a.port, a.count)
    elif a.role == "tcp-sink":
        tcp_sink()
    else:
        tcp_send(a.ip, a.port, a.seconds)


if __name__ == "__main__":
    main()
