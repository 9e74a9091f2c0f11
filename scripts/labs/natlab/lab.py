"""A throwaway NAT lab built from network namespaces, veth pairs, bridges and nftables.

Why it exists: NAT traversal (DCUtR hole punching, relay fallback, our own reachability checks)
cannot be tested on loopback — every peer there is publicly reachable. This module builds, on one
Linux machine, a small "internet" with public hosts on it and home networks behind NAT routers
whose behaviour we choose, so tests and `scripts/bench/bench_nat.py` can run real peers in it.

Topology (one lab; every box is its own network namespace, named `natlab-<id>-<owner>-<host>`):

    pub0 198.18.0.10 ──┐                   ┌── r0 198.18.0.100 │ 10.1.0.1 ── h0 10.1.0.10
    pub1 198.18.0.11 ──┼── "br0" in inet ──┤      (wan)        │ (lan)
                       │  198.18.0.0/24    └── r1 198.18.0.101 │ 10.2.0.1 ── h1 10.2.0.10

198.18.0.0/15 is the benchmarking range and 10/8 is private: no lab address can collide with a
real destination, and nothing is routed out of the lab (no namespace has a link outside it; the
veth pairs are created directly inside lab namespaces, never in the caller's namespace). By default
the lab is IPv4-only (IPv6 is disabled on lab links so nothing bypasses the NAT via link-local
addresses).

NAT variants, applied with nft on each router's WAN leg:
- `cone`: masquerade, which on Linux preserves the source port when it can, so the mapping is
  endpoint-independent; inbound packets that open a new connection (ct state new) are dropped and
  only established/related traffic gets in — a port-restricted cone NAT, the kind where TCP hole
  punching (simultaneous open) works.
- `symmetric`: `snat to <wan> fully-random` — every new connection gets a random public port, so
  the mapping depends on the destination; same inbound drop. Hole punching must fail here.
- `plain_snat`: masquerade without any inbound filter. An unsolicited SYN reaches the router
  itself, which answers RST. In a simultaneous open the SYN that arrives first (before the other
  side's own SYN has left) gets that RST; it travels back through the sender's NAT (ECONNREFUSED
  there) and closes the sender's mapping, so the other SYN is refused as well — traced with nft
  here, and the reason punching fails through plain SNAT too. Two SYNs that leave within one
  one-way delay of each other both meet their own mapping and connect (rare; seen in CI).

IPv6 (`NatLab(..., ipv6=True)`; the IPv4 above is unchanged, the lab becomes dual stack). What a
home router does with IPv6 is usually not NAT but a stateful firewall: every host has a global
address, and the router forwards what its hosts open and drops what the internet opens. So:

    pub0 2001:db8::10 ──┐                    ┌── r0 2001:db8::100 │ 2001:db8:1::1 ── h0 2001:db8:1::10
    pub1 2001:db8::11 ──┼── br0 (same L2) ───┤                    │
                        │  2001:db8::/64     └── r2 2001:db8::102 │ fd00:3::1 ── h2 fd00:3::10 (nat66)

2001:db8::/32 is the documentation prefix. Home i's LAN is 2001:db8:(i+1)::/64 (its own, even
with `same_lan_subnet`), and everything on the internet bridge routes it via router i, as a
provider routes a customer's prefix. Per home, `HomeSpec.v6` picks the router's IPv6 policy, with
nft (table ip6 natlab6) on its WAN leg:
- `firewall` (default): no NAT, a host is seen at its own address; inbound `ct state new` is
  dropped, to the LAN (forward) and to the router (input); established/related and the router's
  neighbour discovery get in — RFC 6092's "simple security". TCP simultaneous open works, as
  through `cone`.
- `nat66`: masquerade onto the router's WAN address from a unique local LAN (fd00:(i+1)::/64,
  routed nowhere), same inbound drop: the IPv6 twin of `cone`.
Addresses are static and usable at once: DAD, router advertisements and SLAAC are off in every
lab namespace, and lab bridges do no MLD snooping (there is no querier). Link-local addresses
remain, as neighbour discovery needs them; they reach no further than one link.

What it does not do: delay or loss emulation — this kernel has no `sch_netem` ("Specified qdisc
kind is unknown"); only rate limits (`tbf`) are offered, see `NatLab.throttle`. No UPnP/NAT-PMP,
no hairpinning, no IPv6-only homes (an IPv6 lab is dual stack), no DHCPv6/prefix delegation.

Use it as a context manager (the lab is removed on exit, on error and on Ctrl-C):

    with NatLab(variants=["cone", "symmetric"]) as lab:
        srv = lab.run("pub0", [sys.executable, "server.py"])
        out = lab.call("h0", [sys.executable, "client.py", lab.public_addr("pub0")])

    with NatLab(["cone", HomeSpec("cone", v6="nat66")], ipv6=True) as lab:
        lab.addr6("h0"), lab.public_addr6("h1")  # 2001:db8:1::10, 2001:db8::101

or by hand: `python -m scripts.labs.natlab.lab up [--ipv6]|down|status` (run `--help`). Needs root (or
CAP_NET_ADMIN + CAP_SYS_ADMIN), iproute2 and nftables.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

NAT_VARIANTS = ("cone", "symmetric", "plain_snat")
V6_POLICIES = ("firewall", "nat66")  # what a home router does with IPv6 (NatLab(ipv6=True))

NETNS_PREFIX = "natlab-"
# Owner tag for labs made by the CLI: they outlive the process that built them on purpose.
MANUAL_OWNER = "m"

INTERNET_PREFIX = "198.18.0"  # /24 on the internet bridge
PUBLIC_HOST_BASE = 10  # pubK gets 198.18.0.(10 + K)
ROUTER_BASE = 100  # home i's router gets 198.18.0.(100 + i) on its WAN leg
MAX_PUBLIC_HOSTS = 80
MAX_HOMES = 150
MAX_HOSTS_PER_HOME = 200

# IPv6 (NatLab(ipv6=True)): the documentation prefix 2001:db8::/32. The host part mirrors the
# IPv4 last octet written as hex digits: pub0 2001:db8::10, r1's WAN 2001:db8::101.
INTERNET6_PREFIX = "2001:db8::"  # /64 on the internet bridge
HOME6_FIREWALL_PREFIX = "2001:db8:{home}::"  # home i's global /64 (home = i + 1), routed to its router
HOME6_NAT66_PREFIX = "fd00:{home}::"  # a NAT66 home's unique local /64, routed nowhere

COMMAND_TIMEOUT_S = 30.0  # any single ip/nft/tc command
PROCESS_STOP_GRACE_S = 2.0  # SIGTERM → SIGKILL for processes still running at teardown

_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_.]{0,23}$")


class LabError(RuntimeError):
    """A lab command failed; the message names the command and what it printed."""


class LabUnavailable(LabError):
    """This machine cannot host a lab (not root, a tool is missing, netns creation refused)."""


@dataclass(frozen=True)
class HomeSpec:
    """One home network: a NAT router and the hosts behind it.

    nat:   one of NAT_VARIANTS.
    hosts: logical names of the hosts on the LAN; empty means the default naming of `NatLab`.
    v6:    one of V6_POLICIES, what the router does with IPv6 when the lab has it (`ipv6=True`):
           "firewall" (global addresses, stateful inbound filter, no NAT) or "nat66".
    """

    nat: str
    hosts: tuple[str, ...] = ()
    v6: str = "firewall"


@dataclass(frozen=True)
class LabHost:
    """One namespace of the lab as a test sees it.

    name:        logical name ("pub0", "r1", "h0", ...).
    role:        "public" (on the internet bridge), "router" (a home's NAT) or "private".
    netns:       the network namespace to run things in (`ip netns exec <netns> ...`).
    addr:        the address the host itself has: public for "public" and "router" (WAN leg),
                 private (10.x) for "private".
    public_addr: the address the internet sees: `addr` for public hosts and routers, the router's
                 WAN address for private hosts.
    home:        index of the home network (routers and private hosts), else None.
    router:      logical name of the router in front of a private host, else None.
    nat:         the NAT variant in front of (or, for a router, on) this host, else None.
    lan_addr:    a router's LAN address (the default gateway of its hosts), else None.
    addr6, public_addr6, lan_addr6: the same three for IPv6 in a lab with `ipv6=True` (else
                 None). Behind a "firewall" router a host's `public_addr6` is its own `addr6`.
    v6:          the IPv6 policy in front of (or, for a router, on) this host, else None.
    """

    name: str
    role: str
    netns: str
    addr: str
    public_addr: str
    home: int | None = None
    router: str | None = None
    nat: str | None = None
    lan_addr: str | None = None
    addr6: str | None = None
    public_addr6: str | None = None
    lan_addr6: str | None = None
    v6: str | None = None


@dataclass
class _Link:
    """Both ends of one veth: (netns, ifname) of the host side and of the upstream side."""

    host_end: tuple[str, str]
    upstream_end: tuple[str, str]


def _fmt_cmd(argv: Sequence[str]) -> str:
    return " ".join(argv)


def run_command(
    argv: Sequence[str], *, input: str | None = None, timeout: float = COMMAND_TIMEOUT_S, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run one admin command, capturing output; raise LabError with its stderr on failure."""
    try:
        proc = subprocess.run(list(argv), input=input, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError as e:
        raise LabUnavailable(
            f"{argv[0]!r} not found: install iproute2 and nftables (apt-get install -y iproute2 nftables)"
        ) from e
    except subprocess.TimeoutExpired as e:
        raise LabError(f"`{_fmt_cmd(argv)}` did not finish within {timeout:.0f} s") from e
    if check and proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip()
        raise LabError(f"`{_fmt_cmd(argv)}` failed with exit code {proc.returncode}: {detail}")
    return proc


def in_netns(netns: str, *argv: str) -> list[str]:
    """argv run inside `netns` (`ip netns exec` execs it: the pid is the command's own)."""
    return ["ip", "netns", "exec", netns, *argv]


def write_sysctl(netns: str, key: str, value: int) -> None:
    """Set a per-namespace sysctl from inside the namespace (no dependency on procps)."""
    path = "/proc/sys/" + key.replace(".", "/")
    run_command(in_netns(netns, "sh", "-c", f"echo {int(value)} > {path}"))


def check_support() -> None:
    """Raise LabUnavailable saying why this machine cannot build a lab; return if it can.

    Checks root, the `ip`, `nft` and `tc` binaries, and that a namespace can really be created
    (containers without CAP_SYS_ADMIN refuse it) and can hold a veth pair and an nft table.
    """
    if os.geteuid() != 0:
        raise LabUnavailable("the NAT lab needs root (network namespaces, nft)")
    missing = [tool for tool in ("ip", "nft", "tc") if shutil.which(tool) is None]
    if missing:
        raise LabUnavailable(f"missing {', '.join(missing)}: apt-get install -y iproute2 nftables")
    probe = f"{NETNS_PREFIX}probe{secrets.token_hex(3)}-{os.getpid()}-x"
    try:
        run_command(["ip", "netns", "add", probe])
        try:
            run_command(["ip", "-n", probe, "link", "add", "name", "va", "type", "veth", "peer", "name", "vb"])
            run_command(in_netns(probe, "nft", "add", "table", "ip", "natlab_probe"))
        finally:
            run_command(["ip", "netns", "del", probe], check=False)
    except LabUnavailable:
        raise
    except LabError as e:
        raise LabUnavailable(f"cannot build a network namespace lab here: {e}") from e


def list_labs() -> dict[str, list[str]]:
    """Every natlab namespace on the machine, grouped by lab id (the `natlab-<id>-` part)."""
    proc = run_command(["ip", "netns", "list"], check=False)
    labs: dict[str, list[str]] = {}
    for line in proc.stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(NETNS_PREFIX):
            continue
        parts = name.split("-")
        if len(parts) >= 4:
            labs.setdefault(parts[1], []).append(name)
    return labs


def _owner_of(netns_names: Iterable[str]) -> str:
    for name in netns_names:
        parts = name.split("-")
        if len(parts) >= 4:
            return parts[2]
    return "?"


def _owner_alive(owner: str) -> bool:
    if owner == MANUAL_OWNER:
        return True
    if not owner.isdigit():
        return False
    try:
        os.kill(int(owner), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_netns_processes(netns: str) -> None:
    """SIGKILL, by pid, whatever still runs inside one of our lab namespaces.

    Only processes whose network namespace is this lab namespace are listed by `ip netns pids`,
    i.e. things started inside the lab; a namespace with live processes would otherwise keep its
    interfaces alive after `ip netns del`.
    """
    proc = run_command(["ip", "netns", "pids", netns], check=False)
    for token in proc.stdout.split():
        if token.isdigit() and int(token) != os.getpid():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(token), signal.SIGKILL)


def destroy_lab(lab_id: str, netns_names: Iterable[str] = ()) -> list[str]:
    """Remove every namespace of lab `lab_id` (and so its veths and bridges); idempotent.

    Returns the namespaces that could not be removed (empty on success).
    """
    names = set(netns_names) | set(list_labs().get(lab_id, []))
    for name in names:
        _kill_netns_processes(name)
    leftovers = []
    for name in sorted(names):
        proc = run_command(["ip", "netns", "del", name], check=False)
        if proc.returncode != 0 and "No such file" not in proc.stderr:
            leftovers.append(name)
    # `ip netns del` only unmounts the name; the kernel frees the namespace (and its veths)
    # once no process is left in it, which is why the processes were killed first.
    remaining = set(list_labs().get(lab_id, []))
    return sorted(set(leftovers) | remaining)


def cleanup_stale() -> list[str]:
    """Remove labs whose owning process is gone (e.g. a test run killed with SIGKILL).

    Labs made with the CLI (`up`) and labs of live processes are left alone. Returns the ids
    removed.
    """
    removed = []
    for lab_id, names in list_labs().items():
        if not _owner_alive(_owner_of(names)):
            destroy_lab(lab_id, names)
            removed.append(lab_id)
    return removed


class SigtermAsExit:
    """While any lab is up in this process, turn SIGTERM into SystemExit so `with` blocks unwind.

    Only when nobody else handles SIGTERM (the handler is SIG_DFL) and only from the main thread
    (Python's rule for installing handlers); otherwise SIGTERM kills us as before and the next
    `cleanup_stale()` removes what is left. Reference-counted over the labs of this process.
    """

    _users = 0
    _installed = False

    @classmethod
    def acquire(cls) -> None:
        cls._users += 1
        if (
            cls._users == 1
            and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        ):
            signal.signal(signal.SIGTERM, cls._handler)
            cls._installed = True

    @classmethod
    def release(cls) -> None:
        cls._users = max(0, cls._users - 1)
        if cls._users == 0 and cls._installed and threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGTERM) is cls._handler:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
            cls._installed = False

    @staticmethod
    def _handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)


def _nft_ruleset(variant: str, wan_if: str, wan_addr: str) -> str:
    """The router's whole nft ruleset for one NAT variant (a table of our own, family ip)."""
    if variant == "cone":
        # Linux NAT keeps the original source port whenever the resulting tuple is unique, so
        # one inside ip:port maps to the same public port for every destination.
        nat_rule = f'oifname "{wan_if}" masquerade'
    elif variant == "symmetric":
        nat_rule = f'oifname "{wan_if}" snat to {wan_addr} fully-random'
    elif variant == "plain_snat":
        nat_rule = f'oifname "{wan_if}" masquerade'
    else:
        raise ValueError(f"unknown NAT variant {variant!r}; choose from {NAT_VARIANTS}")
    rules = [
        "table ip natlab {",
        "  chain postrouting {",
        "    type nat hook postrouting priority srcnat; policy accept;",
        f"    {nat_rule}",
        "  }",
    ]
    if variant in ("cone", "symmetric"):
        # Drop (not reject) anything from the internet that would open a new connection, whether
        # it is routed to the LAN or addressed to the router: a silent drop is what lets a peer's
        # early SYN vanish while our own SYN is still on its way during a simultaneous open.
        for chain, hook in (("forward_in", "forward"), ("input_in", "input")):
            rules += [
                f"  chain {chain} {{",
                f"    type filter hook {hook} priority filter; policy accept;",
                f'    iifname "{wan_if}" ct state established,related accept',
                f'    iifname "{wan_if}" drop',
                "  }",
            ]
    rules.append("}")
    return "\n".join(rules) + "\n"


def _nft_ruleset6(policy: str, wan_if: str) -> str:
    """The router's IPv6 ruleset (a table of our own, family ip6) for one of V6_POLICIES.

    Both policies keep what a home router's IPv6 firewall keeps (RFC 6092): nothing from the
    internet that would open a new connection gets in, to the LAN (forward) or to the router
    (input); established/related traffic does (ICMPv6 errors, e.g. packet-too-big, are related).
    The router answers neighbour discovery on its WAN leg, else nobody there could reach it.
    "nat66" adds a masquerade on the WAN leg (port-preserving, like the IPv4 `cone`).
    """
    if policy not in V6_POLICIES:
        raise ValueError(f"unknown IPv6 policy {policy!r}; choose from {V6_POLICIES}")
    rules = ["table ip6 natlab6 {"]
    if policy == "nat66":
        rules += [
            "  chain postrouting {",
            "    type nat hook postrouting priority srcnat; policy accept;",
            f'    oifname "{wan_if}" masquerade',
            "  }",
        ]
    for chain, hook in (("forward_in", "forward"), ("input_in", "input")):
        rules += [
            f"  chain {chain} {{",
            f"    type filter hook {hook} priority filter; policy accept;",
            f'    iifname "{wan_if}" ct state established,related accept',
        ]
        if hook == "input":
            rules.append(f'    iifname "{wan_if}" icmpv6 type {{ nd-neighbor-solicit, nd-neighbor-advert }} accept')
        rules += [f'    iifname "{wan_if}" drop', "  }"]
    rules.append("}")
    return "\n".join(rules) + "\n"


@dataclass
class _Plan:
    """What `NatLab.up` will build: hosts with their addresses, links, router variants."""

    hosts: dict[str, LabHost] = field(default_factory=dict)
    links: dict[str, _Link] = field(default_factory=dict)  # host logical name → its uplink


def set_rate_limit(
    netns: str, ifname: str, rate_mbit: float, *, latency_ms: float = 50.0, burst_bytes: int | None = None
) -> None:
    """Limit what leaves `ifname` in `netns` to `rate_mbit` with a token bucket (tc tbf).

    latency_ms bounds the queue (packets that would wait longer are dropped): it is the
    bottleneck's buffer, it adds no delay. Replaces an earlier root qdisc on the interface.
    """
    if rate_mbit <= 0:
        raise ValueError("rate_mbit must be > 0")
    rate_bytes = rate_mbit * 1e6 / 8
    # The bucket must hold at least one tick of tokens (HZ may be 100) and one full-size
    # packet; veth hands tbf GSO super-packets, which tbf re-segments when they exceed it.
    burst = burst_bytes or max(32 * 1024, int(rate_bytes / 50))
    tbf = ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", f"{latency_ms}ms"]
    run_command(in_netns(netns, "tc", "qdisc", "replace", "dev", ifname, "root", *tbf))


def clear_rate_limit(netns: str, ifname: str) -> None:
    """Remove the root qdisc `set_rate_limit` put on `ifname`; a no-op where there is none."""
    run_command(in_netns(netns, "tc", "qdisc", "del", "dev", ifname, "root"), check=False)


class NamespaceLab:
    """What every namespace lab shares: naming, lifecycle, running commands inside hosts.

    lab_id: six hex digits naming the lab; random by default. owner: pid whose death makes the
    lab "stale" for `cleanup_stale`; the CLI uses MANUAL_OWNER so its labs persist. Subclasses
    (NatLab here, `scripts.labs.wanlab.lab.WanLab`) implement `_build` (create their namespaces with
    `_add_netns`, fill `self.hosts`); `_prepare` may check a plan before anything is built.

    Contract: nothing is built until `up()` / `__enter__`. If building fails half-way, everything
    built so far is removed before the error propagates. `down()` is idempotent, kills what
    `run()` started (and anything else left inside the lab's namespaces) and removes every
    namespace; it also runs at interpreter exit if the caller forgot. Commands run inside a
    namespace share the caller's filesystem (same venv, same files), only the network differs.

    `ipv6`: False (the default) disables IPv6 on every lab link (`lo` keeps ::1); a subclass that
    sets it True before `up()` gets IPv6 with static addresses only (no DAD, no SLAAC, no RAs).
    """

    ipv6 = False

    def __init__(self, *, lab_id: str | None = None, owner: str | None = None) -> None:
        self.lab_id = lab_id or secrets.token_hex(3)
        self.owner = owner or str(os.getpid())
        if not re.fullmatch(r"[0-9a-f]{6}", self.lab_id):
            raise ValueError(f"lab_id must be six hex digits, not {self.lab_id!r}")
        if not (self.owner == MANUAL_OWNER or self.owner.isdigit()):
            raise ValueError(f"owner must be a pid or {MANUAL_OWNER!r}")
        self.hosts: dict[str, LabHost] = {}
        self.build_seconds: float | None = None
        self._created: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._up = False

    # ----------------------------------------------------------------------------- lifecycle

    def __enter__(self) -> Self:
        self.up()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.down()

    def up(self) -> Self:
        """Build the lab; on any failure remove what was built and raise LabError."""
        if self._up:
            return self
        started = time.monotonic()
        self._prepare()
        atexit.register(self.down)
        SigtermAsExit.acquire()
        self._up = True
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        self.build_seconds = time.monotonic() - started
        return self

    def _prepare(self) -> None:
        """Checks that must pass before anything is built; default: none."""

    def _build(self) -> None:
        raise NotImplementedError

    def describe(self) -> str:
        """A table of the lab's hosts, one per line."""
        raise NotImplementedError

    def down(self) -> None:
        """Stop processes started in the lab and remove all its namespaces; idempotent."""
        if not self._up:
            return
        self._up = False
        with contextlib.suppress(Exception):
            atexit.unregister(self.down)
        SigtermAsExit.release()
        for proc in self._procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
        deadline = time.monotonic() + PROCESS_STOP_GRACE_S
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=PROCESS_STOP_GRACE_S)
        self._procs.clear()
        leftovers = destroy_lab(self.lab_id, self._created)
        self._created.clear()
        if leftovers:
            raise LabError(
                f"could not remove lab namespaces {leftovers}; try `python -m scripts.labs.natlab.lab down {self.lab_id}`"
            )

    # ----------------------------------------------------------------------------- queries

    def host(self, name: str) -> LabHost:
        try:
            return self.hosts[name]
        except KeyError:
            raise KeyError(f"no host {name!r} in this lab; hosts: {sorted(self.hosts)}") from None

    def netns(self, host: str) -> str:
        return self.host(host).netns

    def addr(self, host: str) -> str:
        """The address configured on the host itself (private for hosts behind a NAT)."""
        return self.host(host).addr

    # ----------------------------------------------------------------------------- running

    def run(self, host: str, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start `argv` inside `host`'s namespace; the Popen is stopped at `down()` if alive.

        `ip netns exec` execs the command, so the Popen's pid is the command's own pid.
        """
        self._require_up()
        proc = subprocess.Popen(in_netns(self.netns(host), *argv), **popen_kwargs)
        self._procs.append(proc)
        return proc

    def call(
        self, host: str, argv: Sequence[str], *, timeout: float = 60.0, check: bool = True, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run `argv` in `host`'s namespace to completion, capturing text output."""
        self._require_up()
        return run_command(in_netns(self.netns(host), *argv), input=input, timeout=timeout, check=check)

    # ----------------------------------------------------------------------------- building

    def _netns_name(self, logical: str) -> str:
        return f"{NETNS_PREFIX}{self.lab_id}-{self.owner}-{logical}"

    def _require_up(self) -> None:
        if not self._up:
            raise LabError(f"the lab is not up: use `with {type(self).__name__}(...) as lab:` or call up()")

    def _add_netns(self, name: str) -> None:
        run_command(["ip", "netns", "add", name])
        self._created.append(name)
        if self.ipv6:
            # Addresses usable the moment they are set (no "tentative" during DAD; `nodad` on
            # each address says so again), and none but ours: no router advertisements, no SLAAC.
            # Link-local addresses stay (neighbour discovery uses them); they reach one link only.
            keys = ("accept_dad", "accept_ra", "autoconf")
            script = "; ".join(f"echo 0 > /proc/sys/net/ipv6/conf/{c}/{k}" for c in ("all", "default") for k in keys)
            run_command(in_netns(name, "sh", "-c", script))
        else:
            # IPv4 only: no IPv6 on lab links (lo keeps ::1), so no link-local path around a NAT.
            write_sysctl(name, "net.ipv6.conf.default.disable_ipv6", 1)
        run_command(["ip", "-n", name, "link", "set", "lo", "up"])


class NatLab(NamespaceLab):
    """A lab of public hosts and NATed home networks in network namespaces.

    variants:        one entry per home network: a NAT variant name ("cone", "symmetric",
                     "plain_snat") or a `HomeSpec` naming the hosts. Home i gets router "r{i}"
                     and, by default, hosts "h{i}" (hosts_per_home == 1) or "h{i}_{j}".
    public_hosts:    number of public hosts ("pub0", "pub1", ...) or their names.
    hosts_per_home:  hosts behind each router when a variant is given as a plain string.
    same_lan_subnet: give every home the same LAN (10.1.0.0/24), as real homes do — useful to
                     check that peers do not dial a private address that exists on their own LAN.
                     Default: home i uses 10.{i+1}.0.0/24.
    ipv6:            dual stack: besides the IPv4 above (unchanged), every host gets an IPv6
                     address on 2001:db8::/32, routers forward IPv6 and apply their home's
                     `HomeSpec.v6` policy (default "firewall": no NAT, new inbound connections
                     dropped). Default False: no IPv6 on any lab link.
    lab_id, owner:   see `NamespaceLab`, whose lifecycle contract this lab follows.
    """

    def __init__(
        self,
        variants: Sequence[str | HomeSpec] = ("cone",),
        *,
        public_hosts: int | Sequence[str] = 1,
        hosts_per_home: int = 1,
        same_lan_subnet: bool = False,
        ipv6: bool = False,
        lab_id: str | None = None,
        owner: str | None = None,
    ) -> None:
        super().__init__(lab_id=lab_id, owner=owner)
        self.ipv6 = ipv6
        self.homes = [v if isinstance(v, HomeSpec) else HomeSpec(nat=v) for v in variants]
        if isinstance(public_hosts, int):
            self.public_names = [f"pub{k}" for k in range(public_hosts)]
        else:
            self.public_names = list(public_hosts)
        self.hosts_per_home = hosts_per_home
        self.same_lan_subnet = same_lan_subnet
        self.internet_netns = self._netns_name("inet")
        self._links: dict[str, _Link] = {}
        self._planned: _Plan | None = None
        self._validate()

    def _prepare(self) -> None:
        self._planned = self._plan()  # a bad host name fails here, before anything is built

    def _build(self) -> None:
        plan = self._planned or self._plan()
        self._build_plan(plan)
        self.hosts = plan.hosts
        self._links = plan.links

    def public_addr(self, host: str) -> str:
        """The address the internet sees for this host (its router's WAN address if NATed)."""
        return self.host(host).public_addr

    def addr6(self, host: str) -> str:
        """The host's own IPv6 address (global, or unique local behind NAT66); needs `ipv6=True`."""
        return self._v6(self.host(host).addr6, host)

    def public_addr6(self, host: str) -> str:
        """The IPv6 address the internet sees for this host: its own behind a "firewall" router,
        the router's WAN address behind "nat66"; needs `ipv6=True`."""
        return self._v6(self.host(host).public_addr6, host)

    def _v6(self, addr: str | None, host: str) -> str:
        if addr is None:
            raise LabError(f"{host} has no IPv6 address: build the lab with NatLab(..., ipv6=True)")
        return addr

    def nat_ruleset(self, router: str) -> str:
        """`nft list ruleset` inside a router, for debugging."""
        return run_command(in_netns(self.netns(router), "nft", "list", "ruleset")).stdout

    def describe(self) -> str:
        """A table of the lab's hosts, one per line."""
        lines = [f"lab {self.lab_id} (internet bridge in {self.internet_netns})"]
        for h in self.hosts.values():
            extra = f" nat={h.nat}" if h.nat else ""
            if h.role == "private":
                extra += f" via {h.router} public {h.public_addr}"
            if h.lan_addr:
                extra += f" lan {h.lan_addr}"
            if h.addr6:
                extra += f" v6 {h.addr6}" + (f" ({h.v6})" if h.v6 else "")
            lines.append(f"  {h.name:<10} {h.role:<8} {h.addr:<15} {h.netns}{extra}")
        return "\n".join(lines)

    # ----------------------------------------------------------------------------- shaping

    def throttle(
        self,
        host: str,
        rate_mbit: float,
        *,
        direction: str = "both",
        latency_ms: float = 50.0,
        burst_bytes: int | None = None,
    ) -> None:
        """Limit the rate of `host`'s link to the next hop with a token bucket (tc tbf).

        For a public host or a router this is its internet link; for a private host, its LAN
        link to the router. direction: "up" (egress of the host), "down" (egress of the upstream
        end toward the host) or "both". latency_ms bounds the tbf queue (packets that would wait
        longer are dropped), it adds no delay: this kernel has no netem. Replaces an earlier
        limit on the same link.
        """
        for netns, ifname in self._link_ends(host, direction):
            set_rate_limit(netns, ifname, rate_mbit, latency_ms=latency_ms, burst_bytes=burst_bytes)

    def unthrottle(self, host: str, *, direction: str = "both") -> None:
        """Remove limits set by `throttle` on `host`'s link; a no-op where there is none."""
        for netns, ifname in self._link_ends(host, direction):
            clear_rate_limit(netns, ifname)

    def _link_ends(self, host: str, direction: str) -> list[tuple[str, str]]:
        self._require_up()
        self.host(host)
        link = self._links[host]
        ends = {"up": [link.host_end], "down": [link.upstream_end], "both": [link.host_end, link.upstream_end]}
        if direction not in ends:
            raise ValueError(f"direction must be 'up', 'down' or 'both', not {direction!r}")
        return ends[direction]

    # ----------------------------------------------------------------------------- building

    def _validate(self) -> None:
        if len(self.public_names) > MAX_PUBLIC_HOSTS:
            raise ValueError(f"at most {MAX_PUBLIC_HOSTS} public hosts")
        if len(self.homes) > MAX_HOMES:
            raise ValueError(f"at most {MAX_HOMES} home networks")
        if not 1 <= self.hosts_per_home <= MAX_HOSTS_PER_HOME:
            raise ValueError(f"hosts_per_home must be in 1..{MAX_HOSTS_PER_HOME}")
        for home in self.homes:
            if home.nat not in NAT_VARIANTS:
                raise ValueError(f"unknown NAT variant {home.nat!r}; choose from {NAT_VARIANTS}")
            if home.v6 not in V6_POLICIES:
                raise ValueError(f"unknown IPv6 policy {home.v6!r}; choose from {V6_POLICIES}")
            if len(home.hosts) > MAX_HOSTS_PER_HOME:
                raise ValueError(f"at most {MAX_HOSTS_PER_HOME} hosts per home")

    def _plan(self) -> _Plan:
        plan = _Plan()
        inet = self.internet_netns

        def add(h: LabHost, link: _Link) -> None:
            if not _NAME_RE.match(h.name) or h.name == "inet":
                raise ValueError(f"host name {h.name!r} must match {_NAME_RE.pattern} and not be 'inet'")
            if h.name in plan.hosts:
                raise ValueError(f"host name {h.name!r} used twice")
            plan.hosts[h.name] = h
            plan.links[h.name] = link

        v6 = self.ipv6
        for k, name in enumerate(self.public_names):
            addr = f"{INTERNET_PREFIX}.{PUBLIC_HOST_BASE + k}"
            addr6 = f"{INTERNET6_PREFIX}{PUBLIC_HOST_BASE + k}" if v6 else None
            ns = self._netns_name(name)
            add(
                LabHost(
                    name=name, role="public", netns=ns, addr=addr, public_addr=addr, addr6=addr6, public_addr6=addr6
                ),
                _Link(host_end=(ns, "eth0"), upstream_end=(inet, f"p{k}")),
            )
        for i, home in enumerate(self.homes):
            wan = f"{INTERNET_PREFIX}.{ROUTER_BASE + i}"
            lan_net = "10.1.0" if self.same_lan_subnet else f"10.{i + 1}.0"
            router = f"r{i}"
            rns = self._netns_name(router)
            wan6 = f"{INTERNET6_PREFIX}{ROUTER_BASE + i}" if v6 else None
            # Every firewall home has its own global prefix, as real ones do (same_lan_subnet
            # applies to IPv4 and to NAT66's unique local prefixes).
            lan6_home = 1 if self.same_lan_subnet and home.v6 == "nat66" else i + 1
            lan6 = (HOME6_NAT66_PREFIX if home.v6 == "nat66" else HOME6_FIREWALL_PREFIX).format(home=lan6_home)
            add(
                LabHost(
                    name=router,
                    role="router",
                    netns=rns,
                    addr=wan,
                    public_addr=wan,
                    home=i,
                    nat=home.nat,
                    lan_addr=f"{lan_net}.1",
                    addr6=wan6,
                    public_addr6=wan6,
                    lan_addr6=f"{lan6}1" if v6 else None,
                    v6=home.v6 if v6 else None,
                ),
                _Link(host_end=(rns, "wan"), upstream_end=(inet, f"w{i}")),
            )
            names = home.hosts or (
                (f"h{i}",) if self.hosts_per_home == 1 else tuple(f"h{i}_{j}" for j in range(self.hosts_per_home))
            )
            for j, name in enumerate(names):
                ns = self._netns_name(name)
                addr6 = f"{lan6}{10 + j}" if v6 else None
                add(
                    LabHost(
                        name=name,
                        role="private",
                        netns=ns,
                        addr=f"{lan_net}.{10 + j}",
                        public_addr=wan,
                        home=i,
                        router=router,
                        nat=home.nat,
                        addr6=addr6,
                        public_addr6=addr6 if home.v6 == "firewall" else wan6,
                        v6=home.v6 if v6 else None,
                    ),
                    _Link(host_end=(ns, "eth0"), upstream_end=(rns, f"l{j}")),
                )
        return plan

    def _veth(self, link: _Link, addr_cidr: str, upstream_bridge: str) -> None:
        (hns, hif), (uns, uif) = link.host_end, link.upstream_end
        # Created inside the host namespace with its peer placed straight into the upstream
        # namespace: no interface ever appears in the caller's namespace.
        run_command(["ip", "-n", hns, "link", "add", "name", hif, "type", "veth", "peer", "name", uif, "netns", uns])
        run_command(["ip", "-n", uns, "link", "set", uif, "master", upstream_bridge, "up"])
        run_command(["ip", "-n", hns, "addr", "add", addr_cidr, "dev", hif])
        run_command(["ip", "-n", hns, "link", "set", hif, "up"])

    def _build_plan(self, plan: _Plan) -> None:
        inet = self.internet_netns
        self._add_netns(inet)
        run_command(["ip", "-n", inet, "link", "add", "name", "br0", "type", "bridge", *self._bridge_options()])
        run_command(["ip", "-n", inet, "link", "set", "br0", "up"])
        for h in plan.hosts.values():
            self._add_netns(h.netns)
            if h.role == "router":
                run_command(
                    ["ip", "-n", h.netns, "link", "add", "name", "lan", "type", "bridge", *self._bridge_options()]
                )
                run_command(["ip", "-n", h.netns, "addr", "add", f"{h.lan_addr}/24", "dev", "lan"])
                run_command(["ip", "-n", h.netns, "link", "set", "lan", "up"])
                write_sysctl(h.netns, "net.ipv4.ip_forward", 1)
        for h in plan.hosts.values():
            link = plan.links[h.name]
            if h.role in ("public", "router"):
                self._veth(link, f"{h.addr}/24", "br0")
            else:
                self._veth(link, f"{h.addr}/24", "lan")
                router = plan.hosts[h.router or ""]
                run_command(["ip", "-n", h.netns, "route", "add", "default", "via", router.lan_addr or ""])
        for h in plan.hosts.values():
            if h.role == "router":
                ruleset = _nft_ruleset(h.nat or "", "wan", h.addr)
                run_command(in_netns(h.netns, "nft", "-f", "-"), input=ruleset)
        if self.ipv6:
            self._build_ipv6(plan)

    def _bridge_options(self) -> list[str]:
        # With IPv6, no MLD snooping: the lab has no multicast querier, and neighbour discovery
        # (solicited-node multicast) must never depend on a snooping table's timers.
        return ["mcast_snooping", "0"] if self.ipv6 else []

    def _build_ipv6(self, plan: _Plan) -> None:
        """IPv6 on the IPv4 lab just built: addresses, routes, forwarding, the routers' policies.

        The internet bridge is one flat /64; everything on it (public hosts, routers) gets a
        route to each "firewall" home's /64 via that home's router, as a provider routes a
        customer's delegated prefix. NAT66 homes' unique local prefixes are routed nowhere.
        """
        homes = [
            (str(ipaddress.ip_network(f"{h.lan_addr6}/64", strict=False)), h.addr6, h.name)
            for h in plan.hosts.values()
            if h.role == "router" and h.v6 == "firewall"
        ]
        for h in plan.hosts.values():
            netns, ifname = plan.links[h.name].host_end
            cmds = [f"address add {h.addr6}/64 dev {ifname} nodad"]
            if h.role == "router":
                cmds.append(f"address add {h.lan_addr6}/64 dev lan nodad")
            if h.role == "private":
                cmds.append(f"route add default via {plan.hosts[h.router or ''].lan_addr6}")
            else:
                cmds += [f"route add {prefix} via {wan6}" for prefix, wan6, router in homes if router != h.name]
            run_command(["ip", "-n", netns, "-batch", "-"], input="\n".join(cmds) + "\n")
        for h in plan.hosts.values():
            if h.role == "router":
                write_sysctl(h.netns, "net.ipv6.conf.all.forwarding", 1)
                run_command(in_netns(h.netns, "nft", "-f", "-"), input=_nft_ruleset6(h.v6 or "", "wan"))


# --------------------------------------------------------------------------------- CLI


def keep_up(lab: NamespaceLab) -> None:
    """Build `lab` for a CLI user and leave it up after this process exits; say how to use it."""
    lab.up()
    atexit.unregister(lab.down)  # the CLI's lab outlives this process on purpose
    print(lab.describe())
    print(f"run things with: ip netns exec {lab.netns(next(iter(lab.hosts)))} <cmd>")
    print(f"remove with:     python -m scripts.labs.natlab.lab down {lab.lab_id}")


def _status() -> int:
    labs = list_labs()
    if not labs:
        print("no natlab namespaces")
        return 0
    for lab_id, names in sorted(labs.items()):
        owner = _owner_of(names)
        state = (
            "manual"
            if owner == MANUAL_OWNER
            else (f"owner pid {owner} " + ("alive" if _owner_alive(owner) else "GONE (stale)"))
        )
        print(f"lab {lab_id}: {len(names)} namespaces, {state}")
        for name in sorted(names):
            proc = run_command(["ip", "-j", "-n", name, "addr", "show"], check=False)
            addrs = []
            with contextlib.suppress(ValueError):
                for iface in json.loads(proc.stdout or "[]"):
                    for a in iface.get("addr_info", []):
                        # IPv4, and the global IPv6 of an `--ipv6` lab (IPv6 is off elsewhere)
                        if iface.get("ifname") != "lo" and a.get("scope") != "link":
                            addrs.append(f"{iface['ifname']}={a['local']}")
            print(f"  {name:<40} {' '.join(addrs)}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.labs.natlab.lab",
        description="Build, list or remove network-namespace NAT labs (needs root).",
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="build a lab and leave it running; prints its hosts")
    p_up.add_argument(
        "--variants",
        default="cone,symmetric",
        help=f"comma-separated NAT variants, one home each ({','.join(NAT_VARIANTS)})",
    )
    p_up.add_argument("--public", type=int, default=2, help="number of public hosts")
    p_up.add_argument("--hosts-per-home", type=int, default=1)
    p_up.add_argument("--same-lan-subnet", action="store_true")
    p_up.add_argument("--ipv6", action="store_true", help="dual stack: IPv6 on 2001:db8::/32 as well")
    p_up.add_argument(
        "--v6", default="firewall", choices=V6_POLICIES, help="with --ipv6: every home router's IPv6 policy"
    )
    p_down = sub.add_parser("down", help="remove labs")
    p_down.add_argument("lab_ids", nargs="*", help="lab ids to remove")
    p_down.add_argument("--all", action="store_true", help="remove every lab except those owned by a live process")
    p_down.add_argument("--force", action="store_true", help="with --all: also remove labs owned by live processes")
    sub.add_parser("status", help="list labs and their addresses")
    args = parser.parse_args(argv)

    try:
        if args.cmd == "status":
            return _status()
        if args.cmd == "up":
            check_support()
            variants = [HomeSpec(nat=v.strip(), v6=args.v6) for v in args.variants.split(",") if v.strip()]
            lab = NatLab(
                variants,
                public_hosts=args.public,
                hosts_per_home=args.hosts_per_home,
                same_lan_subnet=args.same_lan_subnet,
                ipv6=args.ipv6,
                owner=MANUAL_OWNER,
            )
            keep_up(lab)
            return 0
        # down
        labs = list_labs()
        targets = list(args.lab_ids)
        if args.all:
            targets += [
                i
                for i, names in labs.items()
                if args.force or _owner_of(names) == MANUAL_OWNER or not _owner_alive(_owner_of(names))
            ]
        if not targets:
            parser.error("name lab ids to remove, or pass --all")
        failed = False
        for lab_id in dict.fromkeys(targets):
            if lab_id not in labs:
                print(f"lab {lab_id}: nothing to remove")
                continue
            leftovers = destroy_lab(lab_id, labs[lab_id])
            failed |= bool(leftovers)
            print(f"lab {lab_id}: " + (f"could not remove {leftovers}" if leftovers else "removed"))
        return 1 if failed else 0
    except LabError as e:
        print(f"natlab: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
