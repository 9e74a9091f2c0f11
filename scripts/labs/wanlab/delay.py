"""The WAN lab's delay line: a user-space process that holds every packet for its link's latency.

Why user space: this kernel has no netem (`Specified qdisc kind is unknown`), so nothing in tc can
delay a packet. The lab's core router (scripts/labs/wanlab/lab.py) routes every packet that arrives
from a peer into a TUN device, `dly`; this process reads each packet, keeps it for the one-way
delay of its (source, destination) pair, and writes it back into `dly`, whence the core routes it
on to the destination peer (policy routing: what comes in from `dly` uses the main table). The
packet itself is untouched, so TCP end to end sees the real round-trip time: its window, its
slow start and the socket buffers must cover latency × bandwidth exactly as on a real WAN. That
is why this is a packet delay line and not a delaying TCP relay (a relay would split each
connection in two short ones and hide the very window limits the lab exists to expose).

Per packet (IPv4 only: the lab disables IPv6): source and destination addresses are read from
the header. one-way delay = half[src] + half[dst] (each peer's configured delay is split over its
two ends, so a uniform `delay_ms` d gives exactly d between any two peers); optional loss drops a
packet with probability 1 − (1 − loss[src])(1 − loss[dst]); optional jitter adds U(0, j) ms with
j = (jitter[src] + jitter[dst]) / 2 but never releases a packet before the previous one of the
same (src, dst) pair — jitter without reordering, like queueing delay that varies, since netem's
reordering jitter is rarely what a real path does. Packets between addresses not configured
pass with no delay.

Config: a JSON file (path on the command line) {"peers": {ip: {"delay_ms", "loss", "jitter_ms"}}};
SIGHUP re-reads it (the lab rewrites it on `shape`). SIGUSR1 writes counters to `<config>.stats`
as JSON: packets, bytes, dropped, max_queue, late_ms_max (how far behind its release time the
latest-released packet went: the line's own error, from scheduling on a busy machine).

Costs: one read and one write system call per packet. The lab uses 9000-byte MTUs (jumbo frames)
so this moves ~6x fewer packets than at 1500; bytes in flight, which is what window and BDP
effects depend on, are unchanged. At 8 × 100 Mbit/s that is ~11k packets/s in each direction.

Run (inside the core namespace, by the lab): python scripts/labs/wanlab/delay.py CONFIG [--tun dly]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import heapq
import json
import os
import random
import select
import signal
import socket
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
MAX_BATCH = 256  # packets read per wake-up before releasing due ones
READ_SIZE = 65536


def open_tun(name: str) -> int:
    """Attach to the (persistent) TUN device `name` in this namespace; non-blocking fd."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


class DelayLine:
    """The per-packet policy and the queue; pure apart from the clock and the RNG it is given."""

    def __init__(self, config: dict, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random(1)
        self.load(config)
        self.heap: list[tuple[float, int, bytes]] = []
        self.last_release: dict[bytes, float] = {}  # (src+dst) -> release time of its last packet
        self.seq = 0
        self.stats = {"packets": 0, "bytes": 0, "dropped": 0, "max_queue": 0, "late_ms_max": 0.0}

    def load(self, config: dict) -> None:
        peers = config.get("peers", {})
        self.half = {socket.inet_aton(ip): float(p.get("delay_ms", 0)) / 2000 for ip, p in peers.items()}
        self.loss = {socket.inet_aton(ip): float(p.get("loss", 0)) for ip, p in peers.items()}
        self.jitter = {socket.inet_aton(ip): float(p.get("jitter_ms", 0)) / 2000 for ip, p in peers.items()}

    def admit(self, pkt: bytes, now: float) -> float | None:
        """Queue `pkt`; return its release time, or None if it was dropped (loss)."""
        if len(pkt) < 20 or pkt[0] >> 4 != 4:
            release = now
            key = b""
        else:
            src, dst = pkt[12:16], pkt[16:20]
            loss_s, loss_d = self.loss.get(src, 0.0), self.loss.get(dst, 0.0)
            if (loss_s or loss_d) and self.rng.random() >= (1 - loss_s) * (1 - loss_d):
                self.stats["dropped"] += 1
                return None
            release = now + self.half.get(src, 0.0) + self.half.get(dst, 0.0)
            key = src + dst
            j = self.jitter.get(src, 0.0) + self.jitter.get(dst, 0.0)
            if j:
                release = max(release + self.rng.random() * j, self.last_release.get(key, 0.0))
                self.last_release[key] = release
        self.seq += 1
        heapq.heappush(self.heap, (release, self.seq, pkt))
        self.stats["packets"] += 1
        self.stats["bytes"] += len(pkt)
        self.stats["max_queue"] = max(self.stats["max_queue"], len(self.heap))
        return release

    def due(self, now: float) -> list[bytes]:
        out = []
        heap = self.heap
        while heap and heap[0][0] <= now:
            release, _, pkt = heapq.heappop(heap)
            out.append(pkt)
            late = (now - release) * 1000
            if late > self.stats["late_ms_max"]:
                self.stats["late_ms_max"] = late
        return out

    def next_release(self) -> float | None:
        return self.heap[0][0] if self.heap else None


def serve(config_path: str, tun: str) -> None:
    # The line is part of the network, not a peer: on a loaded machine the peers it carries must
    # not starve it (a late release is extra latency nobody asked for). It needs little CPU.
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, min(os.getpriority(os.PRIO_PROCESS, 0), -5))
    with open(config_path) as f:
        line = DelayLine(json.load(f))
    fd = open_tun(tun)
    flags = {"reload": False, "dump": False, "stop": False}

    def on_signal(signum: int, frame: object) -> None:
        if signum == signal.SIGHUP:
            flags["reload"] = True
        elif signum == signal.SIGUSR1:
            flags["dump"] = True
        else:
            flags["stop"] = True

    for sig in (signal.SIGHUP, signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    print(json.dumps({"ready": True, "tun": tun}), flush=True)
    clock = time.monotonic
    while not flags["stop"]:
        if flags["reload"]:
            flags["reload"] = False
            with open(config_path) as f:
                line.load(json.load(f))
        if flags["dump"]:
            flags["dump"] = False
            tmp = config_path + ".stats.tmp"
            with open(tmp, "w") as f:
                json.dump(line.stats, f)
            os.replace(tmp, config_path + ".stats")
        nxt = line.next_release()
        timeout = None if nxt is None else max(0.0, nxt - clock())
        try:
            ready, _, _ = select.select([fd], [], [], timeout)
        except InterruptedError:
            continue
        now = clock()
        if ready:
            for _ in range(MAX_BATCH):
                try:
                    pkt = os.read(fd, READ_SIZE)
                except BlockingIOError:
                    break
                line.admit(pkt, now)
        for pkt in line.due(clock()):
            try:
                os.write(fd, pkt)
            except OSError:  # the stack refused it (e.g. no route right now): a lost packet
                line.stats["dropped"] += 1


def main() -> int:
    p = argparse.ArgumentParser(description="the WAN lab's user-space packet delay line (run by the lab)")
    p.add_argument("config")
    p.add_argument("--tun", default="dly")
    args = p.parse_args()
    serve(args.config, args.tun)
    return 0


if __name__ == "__main__":
    sys.exit(main())
