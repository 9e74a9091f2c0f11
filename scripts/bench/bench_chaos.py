"""Chaos soak: real `meshtrain` node processes under random SIGKILL, restart and SIGSTOP, with
the swarm's invariants checked while it runs (what docs/guide.md promises under churn).

    python scripts/bench/bench_chaos.py [--minutes 10] [--nodes 5] [--seed 0] [--partition auto|off]
                                  [--bootstrap one|all] [--skew SECONDS] [--spare NODE]
                                  [--out runs/chaos-...]

What it does, as a new user's swarm would meet churn (spec defaults except the model, H and an
endless run): `meshtrain swarm create --model gpt-tiny --H 20 --steps 0`, the creator starts with
`meshtrain node start`, four (`--nodes` - 1) others `meshtrain swarm join <creator>` at the same
moment. Once they all train (or after `WARMUP_TIMEOUT_S`), every 0.5–8 s (seeded) the harness
picks one action: SIGKILL a random node (the creator included), restart a dead one
(`meshtrain node start --data-dir <its dir> --bootstrap <one random member's last address, alive
or dead>`, i.e. resume, as a user who knows one peer would; `--bootstrap all` gives every running
member's instead), or SIGSTOP one for 5–15 s, then SIGCONT. On loopback every node keeps one
port across its lives, as a daemon keeps its configured one. At least `MIN_ACTIVE` nodes stay running and not stopped.
After `--minutes` of chaos every node is stopped with SIGINT (as Ctrl-C), and checked.

Skew (`--skew S`, Debian's libfaketime): node 1 runs every life with its wall clock shifted by S
seconds (its monotonic clock true, as scripts/bench/bench_skew.py does), so the soak's invariants
hold for a swarm with one drifting clock too; the summary says `"skew": {"node": 1, "seconds": S}`.

Spare (`--spare I`): node I is never SIGKILLed (it is still SIGSTOPped and partitioned like the
others), so one process lives the whole soak and `rss_growth_mib` measures a whole run's growth —
under the full chaos no process lives `RSS_MIN_LIFE_S`. The summary says `"spare": I`.

Partition (root only, `ip netns` working, `--partition auto`): every node runs in its own network
namespace of a `scripts.labs.natlab` lab (public hosts only: one bridge, no NAT, so no nft is needed),
listening on its lab address. Half-way through, the live nodes are split into two groups for
20–30 s by moving one group's bridge ports onto a second, unconnected bridge — a cut cable:
packets between the groups vanish silently, TCP connections stall rather than reset — then
healed. The harness reaches each node's loopback status page by entering its namespace for the
connect (setns on the polling thread). Elsewhere: loopback, `"partition": "skipped: <why>"`.

Invariants, measured from every node's `/status` (polled about once a second) and its log:
- parity_violations: from `training.phi_history` ([[round, φ digest], ...]): for each round r,
  the live peers' digests at r are grouped; a peer whose digest is not the plurality digest at r
  (by the node's own rule, `parity.winning_digest`: a tie goes to the digest whose holders
  include the lowest peer id, the side the node re-syncs the others to) and that, observed
  later, has not reported the plurality digest of r, r+1 or r+2 is a violation (one round of
  slack for the re-sync), unless it reported the plurality digest of
  some later round within `PARITY_HEAL_S` of its odd one: the node's parity check runs on a timer
  and on gossiped digests, and rounds of a few fast steps (5 a second alone) outrun two rounds of
  slack. A peer not observed past r+2 (killed, run over) is counted in `parity_unresolved`
  instead. `null` with `parity_reason` while the node does not report digests.
- join_failures: node processes that exited without our signal (last log lines are kept).
- max_roundless_gap_s: the longest wall-clock span, from the first outer round after chaos
  began to the end of the chaos phase, in which no node's `training.round` went up. Not
  excluded: times with few nodes up — the harness always keeps `MIN_ACTIVE` processes running
  and not stopped, and a round among fewer peers is still a round. Also as a multiple of the
  median round time (`max_roundless_gap_rounds`; the median of per-node intervals between
  consecutive rounds). `max_roundless_gap_able_s` (`_rounds`, `roundless_gap_able_over_round`):
  the same over the spans in which at least two nodes were able to make a round — each past its
  first "training" status, not yet ended, not SIGSTOPped — the share of the gap a protocol can
  close (the chaos may leave both active nodes restarting); `able_s`: how long that was. The
  spread of those gaps, since one maximum says little about the rest: `able_gaps_over_3_rounds`
  (how many exceed 3 median rounds), `able_share_in_long_gaps` (the share of `able_s` they take),
  `able_gaps_over_s` (how many exceed 2, 4, 6, 8, 10, 15, 20 s) and `longest_able_gaps` (the
  eight longest, `[seconds, start t]`).
- corrupt_checkpoints: after the run, every checkpoint under every data dir is loaded and
  digest-checked with `CheckpointStore.load`.
- restart_to_training_s_p50/_max: from a restart's spawn to the first status with
  node.state == "training" (restarts killed again before that are counted, not timed).
- rss_growth_mib: per node process that lived at least `RSS_MIN_LIFE_S`, RSS at its last sample
  minus RSS one minute after it started (the largest; per-process list in the summary, each
  with its RSS about once a minute, `trace`). Under
  this much churn few processes live from minute 1 to the end, hence per process; `--spare`
  keeps one alive (above).
- solo_rounds: rounds whose result was a node's own contribution alone, in a group of one from
  the start, while another trainer still trained (a fresh progress record), was connected to it
  and was within the round window of the round, and did not carry the node's own state (it had
  not just downloaded the node's state of the round before: node/state/parity.py `BesideAlone`)
  (its status, `training.parity.solo_rounds`, summed over lives): a lineage of its own beside a
  live one. A partner further behind re-syncs before
  it can share the round (node/state/parity.py). `survived_rounds`: rounds whose group retries shrank to the node — the partners the
  round dropped were told it failed for them, withhold their φ and re-sync, so no second φ exists.
  `alone_rounds`: all rounds whose result was its own alone while other trainers were in its view,
  solo or not — most are rounds after the only partner was killed (its connection closed: nobody
  else holds a φ for them) or went silent (SIGSTOP, a partition: node/state/parity.py says why a
  lone survivor trains on).
  `rounds_withheld`: rounds a node proceeded alone in after a failed round; it publishes no φ
  for them and re-syncs at once (`parity.withheld`). `actions.restart_dead_bootstrap`: restarts
  whose only bootstrap address was dead.
- Not measured here: exclusion lag needs a misbehaving peer, which
  `scripts/bench/bench_adversarial.py` runs (clock skew is `--skew`, above).
Also: action counts, rounds, `longest_wait` (the longest a node reported the same
`training.waiting`), `max_behind_swarm_s` (the longest a training node stayed more than
`BEHIND_ROUNDS` rounds behind the other training nodes: stalled, or training a lineage of its own),
`parity_split_rounds` (rounds for which two φ digests were ever reported: one φ per round is the
swarm's promise, even where the re-sync rule forgives it), `rounds_redone` (node lives that reported
a round more than `REDO_GRACE_S` after the swarm's front had passed it by `BEHIND_ROUNDS`, with
nobody further on: the front died and the swarm went back, re-training rounds with a second φ;
their reports are kept out of the parity rule, which judges the swarm's front; a front killed
alone counts its rounds as passed when it dies: `Monitor.front_died`), `round_regressions`,
`unclean_shutdowns`
(a final SIGINT that did not exit 0, or 130 from a life that had trained: the CLI exits 130 for
a node stopped before it trained), `log_findings` (counts and first occurrences, file:line, of
worrying lines; `log_tracebacks`: what each top-level traceback raised) and the commit the nodes
ran (`code`: the working tree is shared, and a restarted node imports what is on disk then).

Everything — node data dirs, logs (one per node, `=== chaos: ...` lines mark each start), the
action timeline (`events.jsonl`) and `summary.json` — goes under `--out` (default
`runs/chaos-<time>`, gitignored). Progress goes to stderr; the last stdout line is the JSON.
Not here: delay or loss emulation (this kernel has no netem), NAT between the nodes.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import http.client
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `python scripts/bench/bench_chaos.py` imports scripts.labs.natlab

from meshtrain.node.state.checkpoint import CheckpointError, CheckpointStore  # noqa: E402
from meshtrain.node.state.parity import winning_digest  # noqa: E402
from scripts.bench.bench_skew import faketime_env, faketime_library  # noqa: E402

ACTION_INTERVAL_S = (0.5, 8.0)
STOP_DURATION_S = (5.0, 15.0)
PARTITION_DURATION_S = (20.0, 30.0)
MIN_ACTIVE = 2  # node processes running and not SIGSTOPped, at all times
POLL_INTERVAL_S = 1.0
STATUS_TIMEOUT_S = 2.0
WARMUP_TIMEOUT_S = 120.0
SHUTDOWN_TIMEOUT_S = 30.0
RSS_AT_S = 60.0  # the "minute 1" sample of a process
RSS_MIN_LIFE_S = 180.0
ROUND_WINDOW_S = 5.0
BEHIND_ROUNDS = 2  # a training node this many rounds behind the others is "behind the swarm"
PARITY_HEAL_S = 5.0  # a minority φ matched by the plurality this soon after, at any round, is healed
REDO_GRACE_S = 5.0  # a round reported this long after the front passed it is a redone round
LAB_PORT = 4001
CLONE_NEWNET = 0x40000000
LOG_PATTERNS = {
    "proceeding alone": "proceeding alone",
    "completed alone": "outer round completed alone",
    "out of step": "out of step",
    "Traceback": "Traceback",
    "could not download": "could not download",
    "state download failed": "state download failed",
    "skipping bad checkpoint": "skipping bad checkpoint",
    "no state is offered identically": "no state is offered identically",
}
ACTION_WEIGHTS = {"kill": 0.4, "restart": 0.4, "stop": 0.2}


@dataclass(frozen=True)
class ChaosConfig:
    """One soak.

    minutes:   length of the chaos phase (start-up before it and shutdown after it come on top).
    nodes:     node processes, the creator included; the rest join at once at the start.
    seed:      the chaos RNG (which action, which node, when); the swarm seed stays the spec's.
    partition: "auto" (a netns partition when root and `ip netns` works) or "off".
    out:       run dir for data dirs, logs, events and the summary.
    H, model:  the swarm spec's inner steps per round and model preset.
    log_level: the nodes' log level (INFO: the logs are what a node engineer reads afterwards).
    bootstrap: what a restart is given: "one" random member's last address, alive or dead (a
               user's one bootstrap address), or "all" the running members' addresses.
    skew:      seconds node `SKEWED_NODE`'s wall clock is shifted by, every life (0: none).
    spare:     a node never SIGKILLed (None: any may be), so one process lives the whole soak.
    """

    minutes: float = 10.0
    nodes: int = 5
    seed: int = 0
    partition: str = "auto"
    out: Path = Path("runs/chaos")
    H: int = 20
    model: str = "gpt-tiny"
    log_level: str = "INFO"
    bootstrap: str = "one"
    skew: int = 0
    spare: int | None = None


SKEWED_NODE = 1  # the node whose clock `--skew` shifts (not the creator: its spec is signed at t0)

# --------------------------------------------------------------------------- network


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def connect_in_netns(netns: str | None, addr: tuple[str, int], timeout: float) -> socket.socket:
    """A TCP connection made from inside network namespace `netns` (None: ours). setns affects
    only the calling thread, and a socket keeps the namespace it was created in."""
    if netns is None:
        return socket.create_connection(addr, timeout=timeout)
    libc = _libc()
    with open(f"/run/netns/{netns}") as target, open("/proc/thread-self/ns/net") as home:
        if libc.setns(target.fileno(), CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {netns}: {os.strerror(err)}")
        try:
            return socket.create_connection(addr, timeout=timeout)
        finally:
            if libc.setns(home.fileno(), CLONE_NEWNET) != 0:  # never leave a thread elsewhere
                os._exit(70)


class _NetnsHTTPConnection(http.client.HTTPConnection):
    def __init__(self, netns: str | None, host: str, port: int, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self._netns = netns

    def connect(self) -> None:
        self.sock = connect_in_netns(self._netns, (self.host, self.port), self.timeout)


def http_get_json(netns: str | None, url: str, timeout: float = STATUS_TIMEOUT_S) -> dict | None:
    m = re.match(r"http://([^/:]+):(\d+)(/.*)?$", url.rstrip("/") + "/status")
    if not m:
        return None
    conn = _NetnsHTTPConnection(netns, m.group(1), int(m.group(2)), timeout)
    try:
        conn.request("GET", m.group(3) or "/status", headers={"Connection": "close"})
        resp = conn.getresponse()
        if resp.status != 200:
            return None
        doc = json.loads(resp.read())
        return doc if isinstance(doc, dict) else None
    except (OSError, ValueError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoopbackNet:
    """Every node on 127.0.0.1, each on a port of its own picked once and kept across its
    restarts (as a daemon keeps its configured port, 4001 by default: the addresses a restarted
    node's peers remember stay valid); no partition possible."""

    partition_note = "skipped: --partition off"

    def __init__(self, n: int, note: str | None = None) -> None:
        self.n = n
        self.ports = [free_port() for _ in range(n)]
        if note:
            self.partition_note = note

    def listen(self, i: int) -> str:
        return f"/ip4/127.0.0.1/tcp/{self.ports[i]}"

    def netns(self, i: int) -> str | None:
        return None

    def spawn(self, i: int, argv: list[str], **kw: Any) -> subprocess.Popen:
        return subprocess.Popen(argv, **kw)

    def can_partition(self) -> bool:
        return False

    def down(self) -> None:
        pass


class NetnsNet:
    """Each node in its own namespace of a natlab lab (public hosts on one bridge); a partition
    moves one group's bridge ports onto a second bridge with no link to the first."""

    partition_note = "netns bridge split"

    def __init__(self, n: int) -> None:
        from scripts.labs.natlab.lab import NatLab

        self.n = n
        self.names = [f"pub{i}" for i in range(n)]
        self.lab = NatLab([], public_hosts=self.names)
        self.lab.up()
        self.inet = self.lab.internet_netns
        self._cmd(["ip", "-n", self.inet, "link", "add", "name", "br1", "type", "bridge"])
        self._cmd(["ip", "-n", self.inet, "link", "set", "br1", "up"])
        for i in range(n):  # natlab names public host k's bridge port p{k}; check, do not assume
            self._cmd(["ip", "-n", self.inet, "link", "show", self._port(i)])

    @staticmethod
    def _cmd(argv: list[str]) -> None:
        from scripts.labs.natlab.lab import run_command

        run_command(argv)

    @staticmethod
    def _port(i: int) -> str:
        return f"p{i}"

    def listen(self, i: int) -> str:
        return f"/ip4/{self.lab.addr(self.names[i])}/tcp/{LAB_PORT}"

    def netns(self, i: int) -> str | None:
        return self.lab.netns(self.names[i])

    def spawn(self, i: int, argv: list[str], **kw: Any) -> subprocess.Popen:
        return self.lab.run(self.names[i], argv, **kw)

    def can_partition(self) -> bool:
        return True

    def split(self, group_b: list[int]) -> None:
        for i in group_b:
            self._cmd(["ip", "-n", self.inet, "link", "set", self._port(i), "master", "br1"])

    def heal(self) -> None:
        for i in range(self.n):
            self._cmd(["ip", "-n", self.inet, "link", "set", self._port(i), "master", "br0"])

    def down(self) -> None:
        self.lab.down()


def make_net(cfg: ChaosConfig) -> LoopbackNet | NetnsNet:
    if cfg.partition == "off":
        return LoopbackNet(cfg.nodes)
    if os.geteuid() != 0:
        return LoopbackNet(cfg.nodes, "skipped: not root (network namespaces need it)")
    try:
        from scripts.labs.natlab.lab import LabError, cleanup_stale

        cleanup_stale()
        return NetnsNet(cfg.nodes)
    except (LabError, OSError) as e:
        return LoopbackNet(cfg.nodes, f"skipped: cannot build namespaces ({e})")


# --------------------------------------------------------------------------- nodes


@dataclass
class Life:
    """One process of one node: from spawn to exit."""

    gen: int
    kind: str  # "create", "join", "restart"
    pid: int
    started: float  # harness clock (seconds since the run began)
    log_line: int  # the line of the node's log where this life begins
    training_at: float | None = None
    ended: float | None = None
    end: str | None = None  # "sigkill", "sigint", "exit <rc>"
    peer_id: str | None = None
    rss: list[tuple[float, float]] = field(default_factory=list)  # (t, MiB)
    last_round: int | None = None
    round_times: list[tuple[float, int]] = field(default_factory=list)
    wait: tuple[str, float] | None = None  # (what, since)
    solo_rounds: int = 0  # its status: rounds alone while another trainer trained and was connected
    alone_rounds: int = 0  # its status: rounds whose result was its own alone, other trainers in its view
    survived_rounds: int = 0  # its status: of them, rounds whose group retries shrank to it
    withheld: int = 0  # its status: rounds it proceeded alone in and published no φ for
    stops: list[list[float]] = field(default_factory=list)  # [SIGSTOP t, SIGCONT t] (harness clock)


class NodeSlot:
    def __init__(self, i: int, run: Path, net: LoopbackNet | NetnsNet, cfg: ChaosConfig) -> None:
        self.i, self.net, self.cfg = i, net, cfg
        self.dir = run / "nodes" / f"node{i}"
        self.log = run / f"node{i}.log"
        self.proc: subprocess.Popen | None = None
        self.lives: list[Life] = []
        self.stopped_until: float | None = None
        self.ours = False  # we signalled the current process to end
        self.info: dict[str, Any] = {}
        self.last_addr: str | None = None  # the newest address it announced, alive or dead now

    @property
    def life(self) -> Life | None:
        return self.lives[-1] if self.lives else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def active(self) -> bool:
        return self.running() and self.stopped_until is None

    def spawn(self, kind: str, t: float, extra: list[str]) -> None:
        lines = _count_lines(self.log)
        with open(self.log, "a") as f:
            f.write(f"=== chaos: node{self.i} life {len(self.lives)} ({kind}) at t={t:.1f}s: {' '.join(extra)}\n")
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        if self.i == SKEWED_NODE:
            env.update(faketime_env(self.cfg.skew))
        argv = [sys.executable, "-m", "meshtrain.node.cli", "--log-level", self.cfg.log_level, *extra]
        with open(self.log, "a") as f:
            self.proc = self.net.spawn(
                self.i, argv, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.ours = False
        self.info = {}
        self.lives.append(Life(gen=len(self.lives), kind=kind, pid=self.proc.pid, started=t, log_line=lines + 2))

    def node_flags(self) -> list[str]:
        return [
            "--data-dir",
            str(self.dir),
            "--listen",
            self.net.listen(self.i),
            "--status-port",
            "0",
            "--threads",
            "1",
            "--name",
            f"node{self.i}",
        ]

    def daemon_info(self) -> dict[str, Any]:
        """daemon.json of the current process (a SIGKILLed one leaves a stale file behind)."""
        if self.info or self.proc is None:
            return self.info
        try:
            info = json.loads((self.dir / "daemon.json").read_text())
        except (OSError, ValueError):
            return {}
        if info.get("pid") == self.proc.pid:
            self.info = info
        return self.info

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)

    def addr(self) -> str | None:
        addrs = self.daemon_info().get("addrs") or []
        if addrs:
            self.last_addr = addrs[0]
        return addrs[0] if addrs else None


def _count_lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def _tail_lines(path: Path, start: int, n: int = 25) -> list[str]:
    """The last `n` lines of `path` from line `start` on, as 'file:line: text'."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    first = max(start - 1, len(lines) - n)
    return [f"{path.name}:{k + 1}: {lines[k]}" for k in range(first, len(lines))]


_EXC_LINE = re.compile(r"^[\s|+\-]*((?:[A-Za-z_][\w.]*)?(?:Error|Exception|Interrupt|Exit|Group|Timeout)\b.*)$")
_TRACEBACK = re.compile(r"^(Traceback \(most recent call last\)|  \+ Exception Group Traceback)")


def _raised(lines: list[str], start: int) -> str:
    """What a traceback starting at line index `start` raised: its innermost exception line that
    is not a nursery's ExceptionGroup wrapper (else that wrapper)."""
    found = []
    for line in lines[start : start + 600]:
        if re.match(r"^\d{4}-\d\d-\d\d ", line):  # the next log record
            break
        if (
            (m := _EXC_LINE.match(line))
            and "Traceback (most recent" not in line
            and not line.lstrip(" |+-").startswith("File ")
        ):
            found.append(m.group(1)[:200])
    inner = [x for x in found if not x.startswith(("ExceptionGroup", "BaseExceptionGroup"))]
    return (inner or found or ["?"])[-1 if inner else 0]


def _per_minute(samples: list[tuple[float, float]], started: float) -> list[list[float]]:
    """`samples` ((t, MiB), in time order) cut to the first sample of every minute of the life,
    and the last, as [[t, MiB], ...] rounded."""
    out: list[list[float]] = []
    minute = -1
    for t, mib in samples:
        if int((t - started) // 60) > minute:
            minute = int((t - started) // 60)
            out.append([round(t, 1), round(mib, 1)])
    if samples and out[-1][0] != round(samples[-1][0], 1):
        out.append([round(samples[-1][0], 1), round(samples[-1][1], 1)])
    return out


def _rss_mib(pid: int) -> float | None:
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss / 2**20
    except ImportError:
        pass
    except Exception:  # noqa: BLE001 — the process just went away
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


# --------------------------------------------------------------------------- invariants


class Monitor:
    """What the status pages said, turned into the invariants (thread-safe: the poller writes,
    the chaos loop reads)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.round_events: list[float] = []
        # digests[r][peer] = [(t, digest), ...] in report order
        self.digests: dict[int, dict[str, list[tuple[float, str]]]] = defaultdict(lambda: defaultdict(list))
        self.seen_rounds: dict[str, list[tuple[float, int]]] = defaultdict(list)  # peer -> (t, φ round)
        self.all_digests: dict[int, dict[str, set[str]]] = defaultdict(dict)  # every report, behind or not
        self.reports_behind = 0
        self.peer_rounds: dict[str, set[int]] = defaultdict(set)  # peer -> rounds judged for parity
        self.judged: set[tuple[str, int, str]] = set()  # (peer, round, digest) already classified
        self.high_water = 0  # the highest φ round any node at the swarm's front reported
        self.pass_time: dict[int, float] = {}  # round -> when the swarm's front passed it by BEHIND_ROUNDS
        self.redone: dict[tuple[int, int], dict[str, Any]] = {}  # (node, life) -> first redone report
        # A node training rounds behind the rest of the swarm (stalled, or on a lineage of its own:
        # e.g. restarted without a checkpoint and unable to reach anyone, so it began at round 0).
        self.latest: dict[int, tuple[float, int, str]] = {}  # node -> (t, round, state)
        self.behind: dict[tuple[int, int], dict[str, Any]] = {}  # (node, life) -> open episode
        self.behind_episodes: list[dict[str, Any]] = []
        self.has_phi = False
        self.parity_status = Counter()
        self.polls = 0
        self.polls_failed = 0
        self.longest_wait: dict[str, Any] = {"seconds": 0.0}
        self.round_regressions: list[dict[str, Any]] = []  # a process whose round went down

    def observe(self, slot: NodeSlot, life: Life, t: float, st: dict[str, Any]) -> None:
        node, tr = st.get("node") or {}, st.get("training") or {}
        with self.lock:
            self.polls += 1
            life.peer_id = node.get("peer_id") or life.peer_id
            if node.get("state") == "training" and life.training_at is None:
                life.training_at = t
            rnd = tr.get("round")
            if isinstance(rnd, int):
                if life.last_round is not None and rnd < life.last_round:
                    self.round_regressions.append(
                        {
                            "node": f"node{slot.i}",
                            "life": life.gen,
                            "t": round(t, 1),
                            "from": life.last_round,
                            "to": rnd,
                        }
                    )
                if life.last_round is None or rnd > life.last_round:
                    if life.last_round is not None:
                        self.round_events.append(t)
                    life.round_times.append((t, rnd))
                life.last_round = rnd
            hist = tr.get("phi_history") or []
            if tr.get("phi_round") is not None and tr.get("phi_digest"):
                hist = [*hist, [tr["phi_round"], tr["phi_digest"]]]
            peer = life.peer_id or f"node{slot.i}"
            # Judged by where the node is now: a node training far behind the live swarm (an old
            # checkpoint, or a lineage of its own) is not "at the same round" as the others; its
            # reports go to behind_swarm and parity_split_rounds instead.
            frontier = self._frontier(slot.i, t)
            now_round = tr.get("phi_round") if isinstance(tr.get("phi_round"), int) else rnd
            behind = frontier is not None and isinstance(now_round, int) and now_round < frontier - BEHIND_ROUNDS
            for entry in hist:
                if not (isinstance(entry, list | tuple) and len(entry) == 2):
                    continue
                r, digest = entry
                if not isinstance(r, int) or not isinstance(digest, str):
                    continue
                self.has_phi = True
                self.seen_rounds[peer].append((t, r))
                ever = self.all_digests[r].setdefault(peer, set())
                ever.add(digest)
                if node.get("state") != "training":  # a syncing node's history is its old lineage
                    continue
                if (peer, r, digest) in self.judged:  # phi_history repeats its last rounds: judge once
                    continue
                self.judged.add((peer, r, digest))
                if behind:
                    self.reports_behind += 1
                    continue
                # Or the whole swarm went back: every node at the front is gone and the rest
                # re-train rounds the swarm had passed long before (older checkpoints, or from
                # scratch): a second φ for those rounds, reported as rounds_redone, not as parity.
                passed = self.pass_time.get(r)
                if passed is not None and t > passed + REDO_GRACE_S:
                    if (slot.i, life.gen) not in self.redone:
                        self.redone[(slot.i, life.gen)] = {
                            "node": f"node{slot.i}",
                            "life": life.gen,
                            "t": round(t, 1),
                            "round": r,
                            "high_water": self.high_water,
                        }
                    continue
                if r > self.high_water:
                    for r0 in range(max(0, self.high_water - BEHIND_ROUNDS), r - BEHIND_ROUNDS):
                        self.pass_time.setdefault(r0, t)
                    self.high_water = r
                self.peer_rounds[peer].add(r)
                seen = self.digests[r][peer]
                if not seen or seen[-1][1] != digest:
                    seen.append((t, digest))
            if isinstance(rnd, int):
                self._track_behind(slot.i, life, t, rnd, node.get("state") or "")
            parity = tr.get("parity")
            if isinstance(parity, dict) and parity.get("status"):
                self.parity_status[str(parity["status"])] += 1
            if isinstance(parity, dict):
                life.solo_rounds = max(life.solo_rounds, int(parity.get("solo_rounds") or 0))
                life.alone_rounds = max(life.alone_rounds, int(parity.get("alone_rounds") or 0))
                life.survived_rounds = max(life.survived_rounds, int(parity.get("survived_rounds") or 0))
                life.withheld = max(life.withheld, int(parity.get("withheld") or 0))
            waiting = tr.get("waiting")
            if waiting:
                if life.wait is None or life.wait[0] != waiting:
                    life.wait = (str(waiting), t)
                span = t - life.wait[1]
                if span > self.longest_wait["seconds"]:
                    self.longest_wait = {
                        "seconds": round(span, 1),
                        "node": f"node{slot.i}",
                        "life": life.gen,
                        "waiting": waiting,
                        "since_t": round(life.wait[1], 1),
                    }
            else:
                life.wait = None

    def front_died(self, i: int, t: float, last_round: int | None) -> None:
        """Node `i`, killed at `t`, was the swarm's front alone (its round at the high water, no
        other node training within `BEHIND_ROUNDS` of it): the rounds it reached count as passed
        from `t`, so a report of them `REDO_GRACE_S` later re-trains the dead front's rounds
        (`rounds_redone`), not a second φ beside a live one. Without this, a front that died
        fewer than `BEHIND_ROUNDS` rounds past a round left it to the parity rule: a 30-minute
        soak counted four such redos as parity violations."""
        with self.lock:
            if last_round is None or last_round < self.high_water:
                return
            frontier = self._frontier(i, t)
            if frontier is not None and frontier >= self.high_water - BEHIND_ROUNDS:
                return
            for r0 in range(max(0, self.high_water - BEHIND_ROUNDS), self.high_water + 1):
                self.pass_time.setdefault(r0, t)

    def _frontier(self, i: int, t: float) -> int | None:
        """The highest round the other training nodes reported in the last few seconds."""
        others = [r for j, (t2, r, st) in self.latest.items() if j != i and st == "training" and t - t2 <= 3.0]
        return max(others) if others else None

    def _track_behind(self, i: int, life: Life, t: float, rnd: int, state: str) -> None:
        self.latest[i] = (t, rnd, state)
        frontier = self._frontier(i, t)
        key = (i, life.gen)
        ep = self.behind.get(key)
        if state == "training" and frontier is not None and rnd < frontier - BEHIND_ROUNDS:
            if ep is None:
                self.behind[key] = {
                    "node": f"node{i}",
                    "life": life.gen,
                    "from_t": round(t, 1),
                    "seconds": 0.0,
                    "round": rnd,
                    "swarm_round": frontier,
                }
            else:
                ep.update(seconds=round(t - ep["from_t"], 1), round=rnd, swarm_round=frontier)
        elif ep is not None:
            self.behind_episodes.append(self.behind.pop(key))

    def behind_swarm(self) -> dict[str, Any]:
        """Episodes in which a training node stayed more than BEHIND_ROUNDS rounds behind the
        other training nodes (open ones included: the run ended, or the node was killed)."""
        eps = sorted([*self.behind_episodes, *self.behind.values()], key=lambda e: -e["seconds"])
        return {
            "max_behind_swarm_s": eps[0]["seconds"] if eps else 0.0,
            "behind_swarm_episodes": [e for e in eps if e["seconds"] >= 5.0][:20],
        }

    def parity(self) -> dict[str, Any]:
        if not self.has_phi:
            return {
                "parity_violations": None,
                "parity_reason": "no node reported training.phi_history / phi_digest (the node does not "
                "publish φ digests yet)",
            }
        # The node's own rule (parity.winning_digest): most holders, a tie to the digest whose
        # holders include the lowest peer id — the side the tied loser re-syncs to.
        plurality: dict[int, str] = {}
        for r, peers in self.digests.items():
            holders: dict[str, set[str]] = defaultdict(set)
            for peer, reports in peers.items():
                holders[reports[0][1]].add(peer)
            plurality[r] = winning_digest(holders)
        violations, unresolved = [], []
        splits = [
            {"round": r, "digests": {p[-8:]: sorted(d)[0][:12] for p, d in peers.items()}}
            for r, peers in sorted(self.all_digests.items())
            if len(set().union(*peers.values())) > 1
        ]
        for r in sorted(self.digests):
            peers = self.digests[r]
            for peer, reports in peers.items():
                if reports[0][1] == plurality[r]:
                    continue
                # Matched the majority by r + 2, or at the first round it reported after r (a
                # re-sync can jump a peer several rounds ahead, to the swarm's front), or at any
                # round first seen within PARITY_HEAL_S of the odd digest (the node's parity check
                # is timed, not counted in rounds: rounds of a few steps outrun it).
                t0 = reports[0][0]
                later = [r2 for r2 in self.peer_rounds[peer] if r2 > r]
                healed = any(d == plurality[r] for _, d in reports[1:]) or any(
                    any(
                        d == plurality[r2] and (r2 in (r + 1, r + 2, min(later)) or t - t0 <= PARITY_HEAL_S)
                        for t, d in self.digests.get(r2, {}).get(peer, [])
                    )
                    for r2 in later
                )
                if healed:
                    continue
                rec = {
                    "round": r,
                    "peer": peer[-8:],
                    "digest": reports[0][1][:12],
                    "plurality": plurality[r][:12],
                    "reported_at_t": round(reports[0][0], 1),
                }
                # judged only if the peer went on past r + 2 after it reported the odd digest
                went_on = any(t2 >= reports[0][0] and r2 > r + 2 for t2, r2 in self.seen_rounds[peer])
                (violations if went_on else unresolved).append(rec)
        return {
            "parity_violations": len(violations),
            "parity_violation_list": violations[:20],
            "parity_unresolved": len(unresolved),
            "parity_unresolved_list": unresolved[:20],
            "parity_split_rounds": len(splits),
            "parity_split_list": splits[:20],
            "parity_rounds_checked": len(self.digests),
            "parity_reports_behind_swarm": self.reports_behind,
            "rounds_redone": len(self.redone),
            "rounds_redone_list": list(self.redone.values())[:20],
            "parity_status_reports": dict(self.parity_status),
        }


# --------------------------------------------------------------------------- the soak


class Soak:
    def __init__(self, cfg: ChaosConfig) -> None:
        self.cfg = cfg
        self.run = Path(cfg.out).resolve()
        (self.run / "nodes").mkdir(parents=True, exist_ok=True)
        self.rng = random.Random(cfg.seed)
        self.t0 = time.monotonic()
        self.net: LoopbackNet | NetnsNet | None = None
        self.slots: list[NodeSlot] = []
        self.monitor = Monitor()
        self.events = open(self.run / "events.jsonl", "a")  # noqa: SIM115 — closed in execute()
        self.status_log = open(self.run / "status.jsonl", "a")  # noqa: SIM115 — closed in execute()
        self.actions: Counter = Counter()
        self.join_failures: list[dict[str, Any]] = []
        self.partition: dict[str, Any] | None = None
        self.chaos_start: float | None = None
        self.chaos_end: float | None = None
        self.stop_polling = threading.Event()
        self.load: list[float] = []  # the machine's 1-minute load average at each poll (context for timings)
        self.slots_lock = threading.Lock()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def event(self, name: str, /, **kw: Any) -> None:
        rec = {"t": round(self.now(), 2), "event": name, **kw}
        self.events.write(json.dumps(rec) + "\n")
        self.events.flush()
        print(f"[{rec['t']:7.1f}s] {name} {json.dumps(kw)}", file=sys.stderr, flush=True)

    # -- start-up ------------------------------------------------------------------------------

    def create_swarm(self) -> str:
        creator = self.slots[0]
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "meshtrain.node.cli",
                "swarm",
                "create",
                "--data-dir",
                str(creator.dir),
                "--model",
                self.cfg.model,
                "--H",
                str(self.cfg.H),
                "--steps",
                "0",
                "--name",
                "chaos",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if r.returncode:
            raise RuntimeError(f"swarm create failed: {r.stderr.strip()}")
        return json.loads(r.stdout.splitlines()[0])["swarm_id"]

    def wait_daemon(self, slot: NodeSlot, timeout: float = 120.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not slot.running():
                raise RuntimeError(f"node{slot.i} exited at start-up:\n" + "\n".join(_tail_lines(slot.log, 1)))
            if info := slot.daemon_info():
                return info
            time.sleep(0.2)
        raise RuntimeError(f"node{slot.i} wrote no daemon.json within {timeout:.0f} s; see {slot.log}")

    def code_version(self) -> dict[str, Any]:
        """The commit the nodes run, and uncommitted node files (a shared working tree: a node
        started later imports whatever is on disk then)."""

        def git(*a: str) -> str:
            r = subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True, timeout=30)
            return r.stdout.strip()

        with contextlib.suppress(OSError, subprocess.SubprocessError):
            return {
                "commit": git("rev-parse", "--short", "HEAD"),
                "dirty": git("status", "--porcelain", "--", "meshtrain").splitlines()[:20],
            }
        return {}

    def start(self) -> None:
        self.code_at_start = self.code_version()
        self.net = make_net(self.cfg)
        self.slots = [NodeSlot(i, self.run, self.net, self.cfg) for i in range(self.cfg.nodes)]
        swarm_id = self.create_swarm()
        self.event("swarm_created", swarm_id=swarm_id, run_dir=str(self.run), partition=self.net.partition_note)
        creator = self.slots[0]
        creator.spawn("create", self.now(), ["node", "start", *creator.node_flags()])
        addr = self.wait_daemon(creator)["addrs"][0]
        for s in self.slots[1:]:  # the simultaneous joins
            s.spawn("join", self.now(), ["swarm", "join", addr, *s.node_flags()])
        self.event("joins_started", nodes=len(self.slots) - 1, via=addr)

    # -- polling -------------------------------------------------------------------------------

    def poller(self) -> None:
        with ThreadPoolExecutor(max_workers=len(self.slots)) as pool:
            while not self.stop_polling.is_set():
                began = time.monotonic()
                with self.slots_lock:
                    targets = [(s, s.life) for s in self.slots if s.active() and s.daemon_info().get("status_url")]
                futures = [
                    (s, life, pool.submit(http_get_json, s.net.netns(s.i), s.info["status_url"])) for s, life in targets
                ]
                t = self.now()
                for s, life, fut in futures:
                    st = fut.result()
                    if st is None:
                        self.monitor.polls_failed += 1
                        continue
                    if life is not None:
                        self.monitor.observe(s, life, t, st)
                        self._record_status(s, life, t, st)
                    if life is not None and life.end is None:
                        rss = _rss_mib(life.pid)
                        if rss is not None:
                            life.rss.append((t, rss))
                with contextlib.suppress(OSError):
                    self.load.append(os.getloadavg()[0])
                self.stop_polling.wait(max(0.0, POLL_INTERVAL_S - (time.monotonic() - began)))

    def _record_status(self, s: NodeSlot, life: Life, t: float, st: dict[str, Any]) -> None:
        """One line of status.jsonl: what this poll saw of one node (for reading after the run)."""
        tr = st.get("training") or {}
        rec = {
            "t": round(t, 2),
            "node": s.i,
            "life": life.gen,
            "state": (st.get("node") or {}).get("state"),
            **{k: tr.get(k) for k in ("step", "round", "phi_round", "phi_digest", "phi_history", "parity", "waiting")},
            "peers": len(st.get("peers") or []),
        }
        self.status_log.write(json.dumps(rec) + "\n")

    # -- chaos ---------------------------------------------------------------------------------

    def reap(self) -> None:
        """Notice processes that ended; those we did not end are join failures."""
        for s in self.slots:
            if s.proc is None or s.life is None or s.life.end is not None:
                continue
            rc = s.proc.poll()
            if rc is None:
                continue
            life = s.life
            life.ended = self.now()
            s.stopped_until = None
            if s.ours:
                life.end = life.end or f"exit {rc}"
                continue
            life.end = f"exit {rc}"
            tail = _tail_lines(s.log, life.log_line)
            self.join_failures.append(
                {
                    "node": f"node{s.i}",
                    "life": life.gen,
                    "kind": life.kind,
                    "rc": rc,
                    "t": round(life.ended, 1),
                    "log_tail": tail[-12:],
                }
            )
            self.event(
                "exited_on_its_own", node=s.i, life=life.gen, kind=life.kind, rc=rc, last=tail[-1] if tail else ""
            )

    def active_count(self) -> int:
        return sum(1 for s in self.slots if s.active())

    def act(self) -> None:
        # A node that died before it had the spec can only join again through a live peer.
        anyone = any(o.running() and o.addr() for o in self.slots)
        dead = [s for s in self.slots if not s.running() and (anyone or (s.dir / "swarm.json").exists())]
        active = [s for s in self.slots if s.active()]
        killable = [s for s in active if s.i != self.cfg.spare]
        choices = dict(ACTION_WEIGHTS)
        if not dead:
            choices.pop("restart")
        if len(active) <= MIN_ACTIVE:
            choices.pop("kill")
            choices.pop("stop")
        elif not killable:
            choices.pop("kill")
        if not choices:
            self.actions["skipped"] += 1
            return
        action = self.rng.choices(list(choices), weights=list(choices.values()))[0]
        t = self.now()
        if action == "kill":
            s = self.rng.choice(killable)
            s.ours = True
            s.life.end = "sigkill"  # type: ignore[union-attr]
            s.signal(signal.SIGKILL)
            s.proc.wait()  # type: ignore[union-attr]
            s.life.ended = t  # type: ignore[union-attr]
            self.monitor.front_died(s.i, t, s.life.last_round)  # type: ignore[union-attr]
            self.actions["kill"] += 1
            self.actions["kill_creator"] += s.i == 0
            self.event("sigkill", node=s.i, life=s.life.gen, state=self._state_of(s))  # type: ignore[union-attr]
        elif action == "restart":
            s = self.rng.choice(dead)
            self.restart(s, t)
        else:
            s = self.rng.choice(active)
            dur = self.rng.uniform(*STOP_DURATION_S)
            s.signal(signal.SIGSTOP)
            s.stopped_until = t + dur
            s.life.stops.append([t, t + dur])  # type: ignore[union-attr]
            self.actions["stop"] += 1
            self.event("sigstop", node=s.i, life=s.life.gen, seconds=round(dur, 1))  # type: ignore[union-attr]

    def _state_of(self, s: NodeSlot) -> str:
        life = s.life
        if life is None:
            return "?"
        return "training" if life.training_at is not None else "not yet training"

    def restart(self, s: NodeSlot, t: float) -> None:
        peers = [a for o in self.slots if o is not s and o.running() and (a := o.addr())]
        if self.cfg.bootstrap == "one":  # one random member's last address, alive or dead now
            known = [o.addr() or o.last_addr for o in self.slots if o is not s]
            boot_peers = [self.rng.choice([a for a in known if a])] if any(known) else []
        else:
            boot_peers = peers
        with self.slots_lock:
            if (s.dir / "swarm.json").exists():
                boot = [x for a in boot_peers for x in ("--bootstrap", a)]
                s.spawn("restart", t, ["node", "start", *s.node_flags(), *boot])
            else:  # it died before it had the spec: join again, through any live peer
                s.spawn("restart", t, ["swarm", "join", self.rng.choice(peers), *s.node_flags()])
        self.actions["restart"] += 1
        alive = sum(a in peers for a in boot_peers)
        self.event("restart", node=s.i, life=s.life.gen, bootstrap=len(boot_peers), bootstrap_alive=alive)  # type: ignore[union-attr]
        self.actions["restart_dead_bootstrap"] += bool(boot_peers) and not alive

    def wake(self) -> None:
        t = self.now()
        for s in self.slots:
            if s.stopped_until is not None and t >= s.stopped_until:
                s.signal(signal.SIGCONT)
                s.stopped_until = None
                if s.life is not None and s.life.stops:
                    s.life.stops[-1][1] = t
                self.event("sigcont", node=s.i)

    def maybe_partition(self, t: float, chaos_len: float) -> None:
        net = self.net
        if not isinstance(net, NetnsNet):
            return
        if self.partition is None and t >= self.chaos_start + chaos_len * 0.4:  # type: ignore[operator]
            idx = list(range(len(self.slots)))
            self.rng.shuffle(idx)
            k = len(idx) // 2
            group_b = sorted(idx[:k])
            dur = self.rng.uniform(*PARTITION_DURATION_S)
            net.split(group_b)
            self.partition = {
                "start_t": round(t, 1),
                "seconds": round(dur, 1),
                "group_a": sorted(idx[k:]),
                "group_b": group_b,
                "healed_t": None,
            }
            self.actions["partition"] += 1
            self.event("partition", **self.partition)
        elif (
            self.partition is not None
            and self.partition["healed_t"] is None
            and t >= self.partition["start_t"] + self.partition["seconds"]
        ):
            net.heal()
            self.partition["healed_t"] = round(t, 1)
            self.event("heal")

    def warmup(self) -> None:
        deadline = time.monotonic() + WARMUP_TIMEOUT_S
        while time.monotonic() < deadline:
            self.reap()
            lives = [s.life for s in self.slots]
            if all(life is not None and life.training_at is not None for life in lives):
                break
            time.sleep(0.5)
        self.event("warmup_done", training=sum(1 for s in self.slots if s.life and s.life.training_at is not None))

    def chaos(self) -> None:
        chaos_len = self.cfg.minutes * 60
        self.chaos_start = self.now()
        next_action = self.chaos_start + self.rng.uniform(*ACTION_INTERVAL_S)
        while (t := self.now()) < self.chaos_start + chaos_len:
            self.reap()
            self.wake()
            self.maybe_partition(t, chaos_len)
            if t >= next_action:
                self.act()
                next_action = self.now() + self.rng.uniform(*ACTION_INTERVAL_S)
            time.sleep(0.1)
        self.chaos_end = self.now()

    def shutdown(self) -> dict[str, Any]:
        if isinstance(self.net, NetnsNet) and self.partition and self.partition["healed_t"] is None:
            self.net.heal()
            self.partition["healed_t"] = round(self.now(), 1)
        for s in self.slots:
            if s.stopped_until is not None:
                s.signal(signal.SIGCONT)
                s.stopped_until = None
        self.reap()
        running = [s for s in self.slots if s.running()]
        for s in running:
            s.ours = True
            s.signal(signal.SIGINT)
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
        unclean = []
        for s in running:
            try:
                rc = s.proc.wait(timeout=max(0.1, deadline - time.monotonic()))  # type: ignore[union-attr]
            except subprocess.TimeoutExpired:
                s.signal(signal.SIGKILL)
                s.proc.wait()  # type: ignore[union-attr]
                rc = "timeout"
            s.life.end = f"sigint -> {rc}"  # type: ignore[union-attr]
            s.life.ended = self.now()  # type: ignore[union-attr]
            # 130 is the CLI's exit for a node stopped before it trained ("meshtrain: interrupted"):
            # a clean stop of a life the harness restarted a moment before the end.
            if rc != 0 and not (rc == 130 and s.life.training_at is None):  # type: ignore[union-attr]
                unclean.append({"node": f"node{s.i}", "rc": rc, "log_tail": _tail_lines(s.log, s.life.log_line)[-8:]})  # type: ignore[union-attr]
        self.event("stopped", nodes=len(running), unclean=len(unclean))
        return {"stopped_at_end": len(running), "unclean_shutdowns": unclean}

    # -- results -------------------------------------------------------------------------------

    def checkpoints(self) -> dict[str, Any]:
        corrupt, total, nodes_without = [], 0, []
        for s in self.slots:
            d = s.dir / "checkpoints"
            if not d.is_dir():
                nodes_without.append(f"node{s.i}")
                continue
            store = CheckpointStore(d)
            paths = store.list()
            if not paths:
                nodes_without.append(f"node{s.i}")
            for p in paths:
                total += 1
                try:
                    store.load(p)
                except CheckpointError as e:
                    corrupt.append(str(e))
        return {
            "corrupt_checkpoints": len(corrupt),
            "corrupt_checkpoint_list": corrupt[:20],
            "checkpoints_checked": total,
            "nodes_without_checkpoint": nodes_without,
        }

    def log_findings(self) -> dict[str, Any]:
        counts: Counter = Counter()
        exceptions: Counter = Counter()
        first: dict[str, list[str]] = defaultdict(list)
        for s in self.slots:
            try:
                lines = s.log.read_text(errors="replace").splitlines()
            except OSError:
                continue
            for k, line in enumerate(lines, 1):
                for name, pat in LOG_PATTERNS.items():
                    if name == "Traceback" and _TRACEBACK.match(line):  # top-level ones only
                        exceptions[_raised(lines, k)] += 1
                    elif name == "Traceback" or pat not in line:
                        continue
                    counts[name] += 1
                    if len(first[name]) < 3:
                        first[name].append(f"{s.log.name}:{k}: {line[:300]}")
        return {
            "log_findings": {name: counts.get(name, 0) for name in LOG_PATTERNS},
            "log_tracebacks": dict(exceptions),
            "log_examples": dict(first),
        }

    def gaps(self) -> dict[str, Any]:
        assert self.chaos_start is not None and self.chaos_end is not None
        events = sorted(t for t in self.monitor.round_events if self.chaos_start <= t <= self.chaos_end)
        # Seconds per round of one process over windows of at least ROUND_WINDOW_S between polls
        # that saw its round go up: rounds can be shorter than the poll interval, so Δt/Δround
        # over a few seconds rather than the time between two polls.
        intervals = []
        for s in self.slots:
            for life in s.lives:
                times = life.round_times
                j = 0
                for a in times:
                    while j < len(times) and times[j][0] - a[0] < ROUND_WINDOW_S:
                        j += 1
                    if j == len(times):
                        break
                    b = times[j]
                    if b[1] > a[1]:  # a round that went back (see round_regressions) has no rate
                        intervals.append((b[0] - a[0]) / (b[1] - a[1]))
        median = statistics.median(intervals) if intervals else None
        if not events:
            gap, window = self.chaos_end - self.chaos_start, (self.chaos_start, self.chaos_end)
        else:
            points = [*events, self.chaos_end]
            gap, window = (
                max(((b - a), (a, b)) for a, b in zip(points, points[1:], strict=False))
                if len(points) > 1
                else (0.0, (events[0], events[0]))
            )
        able = self.able_gap(events, median)
        in_window = []
        with contextlib.suppress(OSError):
            for line in (self.run / "events.jsonl").read_text().splitlines():
                rec = json.loads(line)
                if window[0] - 10 <= rec["t"] <= window[1]:
                    in_window.append(rec)
        return {
            "rounds_completed_swarm": len(events),
            "median_round_s": round(median, 2) if median else None,
            "max_roundless_gap_s": round(gap, 1),
            "max_roundless_gap_rounds": round(gap / median, 1) if median else None,
            "max_roundless_gap_window_t": [round(window[0], 1), round(window[1], 1)],
            "events_around_max_gap": in_window[:30],
            **able,
        }

    def able_gap(self, events: list[float], median: float | None) -> dict[str, Any]:
        """The longest span without a round while at least two nodes were able to make one: each
        training (its life past its first "training" status, not yet ended) and not SIGSTOPped.
        `max_roundless_gap_s` also counts windows the chaos left with fewer (both active nodes
        restarting, say), which no protocol can close; this one is the protocol's share.
        Partitions are not excluded (a side of two or more can still make rounds)."""
        assert self.chaos_start is not None and self.chaos_end is not None
        changes: list[tuple[float, int]] = []
        for slot in self.slots:
            for life in slot.lives:
                if life.training_at is None:
                    continue
                start, end = life.training_at, life.ended if life.ended is not None else self.chaos_end
                for a, b in sorted(life.stops):  # training spans between the stops
                    if a > start:
                        changes += [(start, 1), (min(a, end), -1)]
                    start = max(start, b)
                if end > start:
                    changes += [(start, 1), (end, -1)]
        segments, count, opened = [], 0, None
        for t, d in sorted(changes):
            count += d
            if count >= 2 and opened is None:
                opened = t
            elif count < 2 and opened is not None:
                segments.append((opened, t))
                opened = None
        first = events[0] if events else self.chaos_end
        gaps: list[tuple[float, float, float]] = []  # (seconds, from t, to t)
        able_s = 0.0
        for a, b in segments:
            a, b = max(a, first), min(b, self.chaos_end)
            if b <= a:
                continue
            able_s += b - a
            points = [a, *(t for t in events if a < t < b), b]
            gaps += [(y - x, x, y) for x, y in zip(points, points[1:], strict=False)]
        gaps.sort(reverse=True)
        best, window = (gaps[0][0], gaps[0][1:]) if gaps else (0.0, None)
        long = [g for g in gaps if median and g[0] > 3 * median]
        return {
            "max_roundless_gap_able_s": round(best, 1),
            "max_roundless_gap_able_rounds": round(best / median, 1) if median else None,
            "max_roundless_gap_able_window_t": [round(window[0], 1), round(window[1], 1)] if window else None,
            "able_s": round(able_s, 1),
            "able_gaps_over_3_rounds": len(long),
            "able_share_in_long_gaps": round(sum(g[0] for g in long) / able_s, 3) if able_s else None,
            "able_gaps_over_s": {str(k): sum(1 for g in gaps if g[0] > k) for k in (2, 4, 6, 8, 10, 15, 20)},
            "longest_able_gaps": [[round(g[0], 1), round(g[1], 1)] for g in gaps[:8]],
        }

    def restarts(self) -> dict[str, Any]:
        times, never = [], 0
        join_times = []
        for s in self.slots:
            for life in s.lives:
                if life.training_at is not None:
                    (times if life.kind == "restart" else join_times).append(life.training_at - life.started)
                elif life.kind == "restart":
                    never += 1
        return {
            "restart_to_training_s_p50": round(statistics.median(times), 1) if times else None,
            "restart_to_training_s_max": round(max(times), 1) if times else None,
            "restarts_timed": len(times),
            "restarts_never_training": never,
            "start_to_training_s": [round(x, 1) for x in join_times],
        }

    def rss(self) -> dict[str, Any]:
        growth = []
        for s in self.slots:
            for life in s.lives:
                if len(life.rss) < 2 or life.rss[-1][0] - life.started < RSS_MIN_LIFE_S:
                    continue
                base = next(((t, r) for t, r in life.rss if t - life.started >= RSS_AT_S), None)
                if base is None:
                    continue
                growth.append(
                    {
                        "node": f"node{s.i}",
                        "life": life.gen,
                        "from_t": round(base[0], 1),
                        "to_t": round(life.rss[-1][0], 1),
                        "rss_mib_at_1min": round(base[1], 1),
                        "growth_mib": round(life.rss[-1][1] - base[1], 1),
                        # RSS about once a minute: a steady climb (a leak) reads apart from a step
                        # (a cache filled, an arena grown) that stays
                        "trace": _per_minute(life.rss, life.started),
                    }
                )
        longest = max((life.rss[-1][0] - life.started for s in self.slots for life in s.lives if life.rss), default=0.0)
        out: dict[str, Any] = {
            "rss_growth_mib": max((g["growth_mib"] for g in growth), default=None),
            "rss_growth_list": growth,
            "longest_life_s": round(longest, 1),
        }
        if not growth:
            out["rss_reason"] = (
                f"no node process lived {RSS_MIN_LIFE_S:.0f} s (longest {longest:.0f} s): the chaos kills them first"
            )
        return out

    def summary(self, shutdown: dict[str, Any]) -> dict[str, Any]:
        m = self.monitor
        out: dict[str, Any] = {}
        out["join_failures"] = len(self.join_failures)
        out["join_failure_list"] = self.join_failures
        for section in (
            m.parity,
            m.behind_swarm,
            self.gaps,
            self.checkpoints,
            self.restarts,
            self.rss,
            self.log_findings,
        ):
            try:  # one broken measurement must not cost the others after a long soak
                out.update(section())
            except Exception as e:  # noqa: BLE001
                out[f"{section.__name__}_error"] = f"{type(e).__name__}: {e}"
        out["round_regressions"] = m.round_regressions[:20]
        solo = [
            {"node": f"node{s.i}", "life": life.gen, "solo_rounds": life.solo_rounds}
            for s in self.slots
            for life in s.lives
            if life.solo_rounds
        ]
        out["solo_rounds"] = sum(x["solo_rounds"] for x in solo)
        out["solo_round_list"] = solo
        out["rounds_withheld"] = sum(life.withheld for s in self.slots for life in s.lives)
        out["alone_rounds"] = sum(life.alone_rounds for s in self.slots for life in s.lives)
        out["survived_rounds"] = sum(life.survived_rounds for s in self.slots for life in s.lives)
        out["roundless_gap_over_round"] = out.get("max_roundless_gap_rounds")
        out["roundless_gap_able_over_round"] = out.get("max_roundless_gap_able_rounds")
        out["actions"] = {k: int(v) for k, v in self.actions.items()}
        out["skew"] = {"node": SKEWED_NODE, "seconds": self.cfg.skew} if self.cfg.skew else None
        out["spare"] = self.cfg.spare
        out["partition"] = (
            self.partition if self.partition else (self.net.partition_note if self.net else "skipped: no network")
        )
        out["longest_wait"] = m.longest_wait
        out["max_round"] = max((life.last_round or 0 for s in self.slots for life in s.lives), default=0)
        out["polls"], out["polls_failed"] = m.polls, m.polls_failed
        out.update(shutdown)
        out["config"] = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self.cfg).items()}
        out["load_avg_1m"] = (
            {"mean": round(statistics.mean(self.load), 1), "max": round(max(self.load), 1), "cpus": os.cpu_count()}
            if self.load
            else None
        )
        out["code"] = {"at_start": getattr(self, "code_at_start", {}), "at_end": self.code_version()}
        out["chaos_s"] = round((self.chaos_end or 0) - (self.chaos_start or 0), 1)
        out["wall_s"] = round(self.now(), 1)
        out["run_dir"] = str(self.run)
        out.setdefault("parity_violations", None)
        out.setdefault("max_roundless_gap_s", None)
        out.setdefault("corrupt_checkpoints", None)
        out["targets_met"] = {
            "parity_violations": None if out["parity_violations"] is None else out["parity_violations"] == 0,
            "join_failures": out["join_failures"] == 0,
            "max_roundless_gap_s": None if out["max_roundless_gap_s"] is None else out["max_roundless_gap_s"] <= 30,
            "corrupt_checkpoints": None if out["corrupt_checkpoints"] is None else out["corrupt_checkpoints"] == 0,
            "solo_rounds": out["solo_rounds"] == 0,
            "roundless_gap_over_round": None
            if out["roundless_gap_over_round"] is None
            else out["roundless_gap_over_round"] <= 3,
            "roundless_gap_able_over_round": None
            if out.get("roundless_gap_able_over_round") is None
            else out["roundless_gap_able_over_round"] <= 3,
            "rss_growth_mib": None if out.get("rss_growth_mib") is None else out["rss_growth_mib"] <= 20,
        }
        return out

    def execute(self) -> dict[str, Any]:
        poller = threading.Thread(target=self.poller, name="chaos-poller", daemon=True)
        try:
            self.start()
            poller.start()
            self.warmup()
            self.chaos()
            shutdown = self.shutdown()
            self.stop_polling.set()
            poller.join(10)
            result = self.summary(shutdown)
            (self.run / "summary.json").write_text(json.dumps(result, indent=1))
            return result
        finally:
            self.stop_polling.set()
            for s in self.slots:
                if s.running():
                    s.signal(signal.SIGCONT)
                    s.signal(signal.SIGKILL)
            if self.net is not None:
                self.net.down()
            self.events.close()
            self.status_log.close()


def run_soak(cfg: ChaosConfig) -> dict[str, Any]:
    """Run one soak; returns the summary (also written to `<out>/summary.json`)."""
    return Soak(cfg).execute()


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="length of the chaos phase (default 10)")
    ap.add_argument("--nodes", type=int, default=5, help="node processes, the creator included (default 5)")
    ap.add_argument("--seed", type=int, default=0, help="chaos RNG seed (default 0)")
    ap.add_argument(
        "--partition",
        choices=["auto", "off"],
        default="auto",
        help="auto: a netns partition when root (default); off: loopback only",
    )
    ap.add_argument("--H", type=int, default=20, help="inner steps per outer round (default 20)")
    ap.add_argument("--model", default="gpt-tiny", help="model preset (default gpt-tiny)")
    ap.add_argument("--log-level", default="INFO", help="the nodes' log level (default INFO)")
    ap.add_argument(
        "--bootstrap",
        choices=["one", "all"],
        default="one",
        help="a restart's bootstrap: one random member's address, alive or dead (default), or all running ones",
    )
    ap.add_argument(
        "--skew", type=int, default=0, help="shift node 1's wall clock by this many seconds (libfaketime; default 0)"
    )
    ap.add_argument(
        "--spare",
        type=int,
        default=None,
        help="a node never SIGKILLed, so RSS growth covers a whole run (default none)",
    )
    ap.add_argument("--out", default=None, help="run dir (default runs/chaos-<UTC time>)")
    args = ap.parse_args(argv)
    if args.nodes < 3:
        ap.error("--nodes must be at least 3 (chaos keeps 2 running)")
    if args.skew and faketime_library() is None:
        ap.error("--skew needs libfaketime (apt-get install faketime)")
    if args.spare is not None and not 0 <= args.spare < args.nodes:
        ap.error(f"--spare must be a node index in [0, {args.nodes})")
    out = Path(args.out) if args.out else ROOT / "runs" / time.strftime("chaos-%Y%m%d-%H%M%S", time.gmtime())
    print(f"chaos soak: run dir {out}", file=sys.stderr, flush=True)
    cfg = ChaosConfig(
        minutes=args.minutes,
        nodes=args.nodes,
        seed=args.seed,
        partition=args.partition,
        out=out,
        H=args.H,
        model=args.model,
        log_level=args.log_level,
        bootstrap=args.bootstrap,
        skew=args.skew,
        spare=args.spare,
    )
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # unwind: the nodes and the lab are cleaned up
    result = run_soak(cfg)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
