"""A WAN lab: N peers, each on its own rate-limited, delayed link, in network namespaces.

Why it exists: collectives are meant for peers on links of 10 Mbit/s to 1 Gbit/s with tens of
milliseconds between them. On loopback the CPU is the bottleneck and latency is zero, so a
benchmark there measures the wrong thing. This lab (an extension of scripts/labs/natlab: same
namespace naming, lifecycle and cleanup, `NamespaceLab`) gives each peer its own link:

    p0 10.200.0.2 ─eth0══p0─┐
    p1 10.200.1.2 ─eth0══p1─┼─ core (router) ── dly (TUN) ⇄ delay line (user space, delay.py)
    ...                     │
    p7 10.200.7.2 ─eth0══p7─┘

- Every box is a network namespace `natlab-<lab id>-<owner pid | m>-<host>` (so natlab's
  `status`, `down --all` and `cleanup_stale()` see wan labs too). Peer i sits on 10.200.i.0/24
  (10.200.i.2; the core is 10.200.i.1 and its default route). Nothing routes out of the lab: the
  veth pairs are created inside lab namespaces, no lab namespace has a link outside it, and the
  lab is IPv4-only.
- **Rate**, both directions: tc tbf on the peer's eth0 (its upload) and on the core's end of its
  veth (its download), default 100 Mbit/s. The tbf queue (`queue_ms`, default 50 ms at the link
  rate) is the bottleneck buffer; traffic from several senders to one peer queues at its
  download, as at a real access link.
- **Latency**: the kernel here has no netem, so delay happens in user space, on packets: the core
  routes whatever comes from a peer into the TUN device `dly` (policy rule: not from `dly` →
  table 100 → `dly`), the delay line (delay.py) holds each packet for its pair's one-way delay and
  writes it back, and the core routes it to the destination (rule: from `dly` → main table).
  TCP end to end sees the real RTT, so windows and socket buffers matter as on a real WAN — a
  delaying TCP relay was rejected because it would split each connection into two short-RTT
  ones and hide exactly that. A test hook in the data plane was rejected because it would only
  delay our own traffic, not hivemind's, and not the TCP handshake or ACKs.
  One-way delay between peers a and b = (delay_ms[a] + delay_ms[b]) / 2.
- **Loss and jitter** (optional, per peer, in the delay line): Bernoulli loss per packet, and
  jitter that never reorders a pair's packets (see delay.py). No bandwidth variation.
- MTU 9000 on every lab link (jumbo frames): the delay line moves one read and one write per
  packet in Python, and 6x fewer packets keep its CPU small on a 2-core machine. Bytes in
  flight, which window and BDP effects depend on, are the same as at 1500.

What it does not do: a shared bottleneck between peers other than each peer's own access link
(the core is infinitely fast, as an idealised internet); asymmetric routes; IPv6; NAT (use
natlab for that).

    with WanLab(8, rate_mbit=100, delay_ms=20) as lab:          # every pair: 20 ms one-way
        lab.shape("p3", rate_mbit=20)                            # one slow peer, both directions
        proc = lab.run("p0", [sys.executable, "server.py"])     # a process inside peer p0
        lab.addr("p0")                                           # 10.200.0.2
        lab.measure_delay()  # checks: added one-way latency per pair, from probe packets

Needs root (CAP_NET_ADMIN + CAP_SYS_ADMIN), iproute2 and /dev/net/tun. By hand:
`python -m scripts.labs.wanlab.lab up --peers 4 --rate 100 --delay 20` (stays up; remove with
`python -m scripts.labs.natlab.lab down <id>`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from scripts.labs.natlab.lab import (
    MANUAL_OWNER,
    LabError,
    LabHost,
    LabUnavailable,
    NamespaceLab,
    check_support,
    keep_up,
    run_command,
    set_rate_limit,
    write_sysctl,
)

ROOT = Path(__file__).resolve().parents[3]
DELAY_SCRIPT = str(Path(__file__).resolve().parent / "delay.py")
PROBE_SCRIPT = str(Path(__file__).resolve().parent / "probe.py")
MTU = 9000
MAX_PEERS = 250
TUN = "dly"
DELAY_TABLE = "100"
DELAY_READY_TIMEOUT = 20.0
CONGESTION_SYSCTL = "/proc/sys/net/ipv4/tcp_congestion_control"  # per namespace


@dataclass(frozen=True)
class LinkShape:
    """One peer's access link. up/down in Mbit/s (None: unlimited); delay, jitter in ms; loss a
    probability per packet; queue_ms bounds the tbf queue at the link rate."""

    up_mbit: float | None = 100.0
    down_mbit: float | None = 100.0
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0
    queue_ms: float = 50.0

    def __post_init__(self) -> None:
        for rate in (self.up_mbit, self.down_mbit):
            if rate is not None and rate <= 0:
                raise ValueError("a link rate must be > 0 Mbit/s (None: unlimited)")
        if self.delay_ms < 0 or self.jitter_ms < 0 or self.queue_ms <= 0:
            raise ValueError("delay_ms and jitter_ms must be >= 0 and queue_ms > 0")
        if not 0 <= self.loss < 1:
            raise ValueError("loss must be in [0, 1)")


class WanLab(NamespaceLab):
    """N peers ("p0" … "p{N-1}") behind their own shaped links, joined by one core router.

    peers:     how many peers (1..250).
    rate_mbit: every link's rate, both directions (None: unlimited); `shape` changes one peer.
    delay_ms:  one-way delay between any two peers (each peer's link carries it; see `shape`).
    jitter_ms, loss, queue_ms: defaults of every link, see `LinkShape`.
    congestion: the TCP congestion control of every peer's namespace (cubic, bbr, ...); None keeps
               what a new namespace inherits from the machine (`tcp_congestion` reads it).
    lab_id, owner: see `NamespaceLab` (lifecycle contract, cleanup, Ctrl-C and SIGTERM).
    """

    def __init__(
        self,
        peers: int,
        *,
        rate_mbit: float | None = 100.0,
        delay_ms: float = 0.0,
        jitter_ms: float = 0.0,
        loss: float = 0.0,
        queue_ms: float = 50.0,
        congestion: str | None = None,
        lab_id: str | None = None,
        owner: str | None = None,
    ) -> None:
        super().__init__(lab_id=lab_id, owner=owner)
        if not 1 <= peers <= MAX_PEERS:
            raise ValueError(f"peers must be in 1..{MAX_PEERS}")
        if congestion is not None and not congestion.isalnum():
            raise ValueError(f"congestion must name a TCP congestion control (cubic, bbr, ...), not {congestion!r}")
        self.congestion = congestion
        default = LinkShape(rate_mbit, rate_mbit, delay_ms, jitter_ms, loss, queue_ms)
        self.names = [f"p{i}" for i in range(peers)]
        self.shapes: dict[str, LinkShape] = dict.fromkeys(self.names, default)
        self.core_netns = self._netns_name("core")
        self._config_dir: str | None = None
        self._delay_proc: subprocess.Popen[str] | None = None

    # ----------------------------------------------------------------------------- shaping

    def shape(self, peer: str, **changes: float | None) -> LinkShape:
        """Change `peer`'s link: fields of `LinkShape`, or `rate_mbit` for both directions; the
        rest keeps its value. Takes effect at once, for connections already open too."""
        if peer not in self.shapes:
            raise KeyError(f"no peer {peer!r} in this lab; peers: {self.names}")
        if "rate_mbit" in changes:
            rate = changes.pop("rate_mbit")
            changes.setdefault("up_mbit", rate)
            changes.setdefault("down_mbit", rate)
        new = replace(self.shapes[peer], **changes)
        self.shapes[peer] = new
        if self._up:
            self._apply_rates(peer)
            self._write_delay_config(reload=True)
        return new

    @property
    def delay_pid(self) -> int | None:
        """The delay line's process id (to account its CPU), None while the lab is down."""
        return self._delay_proc.pid if self._delay_proc is not None else None

    def tcp_congestion(self, peer: str) -> str:
        """The TCP congestion control `peer`'s connections use: `congestion` if the lab was given
        one, else what a new namespace inherits from the machine (Linux copies the initial
        namespace's default: cubic on most machines, bbr on some)."""
        self._require_up()
        return run_command(["ip", "netns", "exec", self.netns(peer), "cat", CONGESTION_SYSCTL]).stdout.strip()

    def one_way_ms(self, a: str, b: str) -> float:
        """The configured one-way delay from a to b (ms)."""
        return (self.shapes[a].delay_ms + self.shapes[b].delay_ms) / 2

    def delay_stats(self) -> dict:
        """The delay line's counters (packets, bytes, dropped, max_queue, late_ms_max)."""
        self._require_up()
        assert self._delay_proc is not None and self._config_dir is not None  # set by _build
        path = os.path.join(self._config_dir, "delay.json.stats")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self._delay_proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with contextlib.suppress(FileNotFoundError, ValueError), open(path) as f:
                return json.load(f)
            time.sleep(0.02)
        raise LabError("the delay line did not report its counters")

    def measure_delay(self, pairs: Sequence[tuple[str, str]] | None = None, probes: int = 20) -> dict[str, dict]:
        """Send small UDP probes a → b and report the one-way latency they saw (ms): every lab
        namespace shares the machine's monotonic clock, so one-way is measured directly, not
        halved from an RTT. Returns {"a->b": {"configured", "median", "min", "max"}}."""
        if pairs is None:
            pairs = [(self.names[0], self.names[-1])] if len(self.names) > 1 else []
        out = {}
        for a, b in pairs:
            srv = self.run(
                b, [sys.executable, PROBE_SCRIPT, "udp-sink", "--count", str(probes)], stdout=subprocess.PIPE
            )
            try:
                assert srv.stdout is not None
                ready = json.loads(srv.stdout.readline())
                self.call(
                    a,
                    [
                        sys.executable,
                        PROBE_SCRIPT,
                        "udp-send",
                        self.addr(b),
                        str(ready["port"]),
                        "--count",
                        str(probes),
                    ],
                    timeout=60,
                )
                result = json.loads(srv.stdout.readline())
            finally:
                srv.kill()
                srv.wait()
            out[f"{a}->{b}"] = {"configured": self.one_way_ms(a, b), **result}
        return out

    def measure_rate(self, a: str, b: str, seconds: float = 2.0) -> float:
        """Goodput of one TCP stream a → b over `seconds` (Mbit/s), after a second of warm-up."""
        srv = self.run(b, [sys.executable, PROBE_SCRIPT, "tcp-sink"], stdout=subprocess.PIPE, text=True)
        try:
            assert srv.stdout is not None
            ready = json.loads(srv.stdout.readline())
            res = self.call(
                a,
                [sys.executable, PROBE_SCRIPT, "tcp-send", self.addr(b), str(ready["port"]), "--seconds", str(seconds)],
                timeout=seconds + 60,
            )
            return float(json.loads(res.stdout.strip().splitlines()[-1])["mbit_s"])
        finally:
            srv.kill()
            srv.wait()

    # ----------------------------------------------------------------------------- building

    def _build(self) -> None:
        core = self.core_netns
        self._add_netns(core)
        write_sysctl(core, "net.ipv4.ip_forward", 1)
        for key in ("net.ipv4.conf.all.rp_filter", "net.ipv4.conf.default.rp_filter"):
            write_sysctl(core, key, 0)
        run_command(["ip", "-n", core, "tuntap", "add", "dev", TUN, "mode", "tun"])
        run_command(["ip", "-n", core, "link", "set", TUN, "mtu", str(MTU), "txqueuelen", "10000", "up"])
        run_command(["ip", "-n", core, "route", "add", "default", "dev", TUN, "table", DELAY_TABLE])
        run_command(["ip", "-n", core, "rule", "add", "iif", TUN, "lookup", "main", "pref", "100"])
        run_command(["ip", "-n", core, "rule", "add", "lookup", DELAY_TABLE, "pref", "200"])
        for i, name in enumerate(self.names):
            ns = self._netns_name(name)
            self._add_netns(ns)
            addr = f"10.200.{i}.2"
            self.hosts[name] = LabHost(name=name, role="peer", netns=ns, addr=addr, public_addr=addr)
            run_command(
                ["ip", "-n", ns, "link", "add", "name", "eth0", "type", "veth", "peer", "name", name, "netns", core]
            )
            run_command(["ip", "-n", ns, "link", "set", "eth0", "mtu", str(MTU), "up"])
            run_command(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0"])
            run_command(["ip", "-n", ns, "route", "add", "default", "via", f"10.200.{i}.1"])
            if self.congestion is not None:
                run_command(["ip", "netns", "exec", ns, "sh", "-c", f"echo {self.congestion} > {CONGESTION_SYSCTL}"])
            run_command(["ip", "-n", core, "link", "set", name, "mtu", str(MTU), "up"])
            run_command(["ip", "-n", core, "addr", "add", f"10.200.{i}.1/24", "dev", name])
            write_sysctl(core, f"net.ipv4.conf.{name}.rp_filter", 0)
            self._apply_rates(name)
        write_sysctl(core, f"net.ipv4.conf.{TUN}.rp_filter", 0)
        self._start_delay_line()

    def _apply_rates(self, peer: str) -> None:
        s = self.shapes[peer]
        for netns, ifname, rate in ((self.netns(peer), "eth0", s.up_mbit), (self.core_netns, peer, s.down_mbit)):
            if rate is None:
                run_command(["ip", "netns", "exec", netns, "tc", "qdisc", "del", "dev", ifname, "root"], check=False)
            else:
                # The bucket holds at least two jumbo frames: tbf must pass a whole packet.
                burst = max(4 * MTU, int(rate * 1e6 / 8 / 50))
                set_rate_limit(netns, ifname, rate, latency_ms=s.queue_ms, burst_bytes=burst)

    def _write_delay_config(self, reload: bool = False) -> None:
        assert self._config_dir is not None
        peers = {
            self.addr(n): {"delay_ms": s.delay_ms, "loss": s.loss, "jitter_ms": s.jitter_ms}
            for n, s in self.shapes.items()
        }
        path = os.path.join(self._config_dir, "delay.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"peers": peers}, f)
        os.replace(tmp, path)
        if reload and self._delay_proc is not None:
            self._delay_proc.send_signal(signal.SIGHUP)

    def _start_delay_line(self) -> None:
        self._config_dir = tempfile.mkdtemp(prefix=f"wanlab-{self.lab_id}-")
        self._write_delay_config()
        proc = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                self.core_netns,
                sys.executable,
                DELAY_SCRIPT,
                os.path.join(self._config_dir, "delay.json"),
                "--tun",
                TUN,
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        self._procs.append(proc)
        self._delay_proc = proc
        assert proc.stdout is not None
        line = proc.stdout.readline()  # {"ready": true} once attached to the TUN device
        if not line:
            raise LabError(f"the delay line exited with code {proc.wait()} before it was ready")

    def down(self) -> None:
        super().down()
        self._delay_proc = None
        if self._config_dir is not None:
            with contextlib.suppress(OSError):
                for f in os.listdir(self._config_dir):
                    os.unlink(os.path.join(self._config_dir, f))
                os.rmdir(self._config_dir)
            self._config_dir = None

    def describe(self) -> str:
        lines = [f"wan lab {self.lab_id} (core router in {self.core_netns})"]
        for n in self.names:
            s = self.shapes[n]
            lines.append(
                f"  {n:<4} {self.addr(n) if self._up else '-':<13} up {s.up_mbit} down {s.down_mbit} Mbit/s, "
                f"delay {s.delay_ms} ms, jitter {s.jitter_ms} ms, loss {s.loss}"
            )
        return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.labs.wanlab.lab", description="Build a WAN lab and leave it up (root)."
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="build a lab and leave it running; prints its peers")
    up.add_argument("--peers", type=int, default=4)
    up.add_argument("--rate", type=float, default=100.0, help="Mbit/s per link, both directions")
    up.add_argument("--delay", type=float, default=20.0, help="one-way delay between peers, ms")
    args = parser.parse_args(argv)
    try:
        check_support()
        lab = WanLab(args.peers, rate_mbit=args.rate, delay_ms=args.delay, owner=MANUAL_OWNER)
        keep_up(lab)
        return 0
    except (LabError, LabUnavailable) as e:
        print(f"wanlab: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
