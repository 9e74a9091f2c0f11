"""hivemind's all-reduce time for N peers (runs in hivemind's venv; see scripts/bench/hivemind_anchor.py).

    .venv-hivemind/bin/python scripts/bench/hivemind_probe_allreduce.py --peers 8 --mb 100 [--rounds 2]

What it measures: how long hivemind's `DecentralizedAverager` takes to average MB megabytes of fp32
across N peers, each a separate process, on loopback (host_maddrs /ip4/127.0.0.1/tcp/0; no
relay, no auto-relay, no AutoNAT, no UPnP/NAT-PMP, no IPFS bootstrap) — or, with `--lab FILE`, in
the WAN lab (scripts/labs/wanlab/): FILE is JSON {"netns": [name per peer], "hosts": [ip per peer]};
worker i runs inside netns[i] (`ip netns exec`, as root) and listens on /ip4/hosts[i]/tcp/0, so
its traffic crosses the lab's rate-limited, delayed links (scripts/bench/bench_wan.py writes FILE).

How: worker 0 starts the first `hivemind.DHT`; the others bootstrap from its address. Each worker
holds MB megabytes of random fp32 split like scripts/bench/bench_allreduce.py (three quarters in three
big tensors, the rest in 4096-float tensors) in a `DecentralizedAverager` with
target_group_size = min_group_size = N. When every worker is up, the parent releases them together
with one common `scheduled_time` per round; each calls `step(require_trigger=True, wait=False)`,
so hivemind's DHT matchmaking runs first (untimed), and as soon as its step reaches
AWAITING_TRIGGER the worker calls `allow_allreduce()` and waits for the result. Times are
wall-clock (one machine, one clock):
- `hivemind_s`: the all-reduce itself — from the moment the *last* peer triggered (before that no
  group can finish) to the moment the last peer finished; like our `allreduce_s`, group formation is
  excluded. With `--rounds` > 1 it is the median over rounds (the first round included: the
  daemons are already connected through the DHT by then);
- `per_peer_max_s`: max over peers of (own trigger → own completion) — the brief's "max over peers"
  reading, which also counts waiting for slower peers to finish matchmaking;
- `step_s`: max over peers of (`step()` call → completion), i.e. matchmaking + all-reduce;
- `matchmaking_s`: from the common release to the last trigger.
`group_size_reached` is the smallest group any peer saw in any round; `results_agree` says every
peer ended every round holding the mean of all peers' tensors (sums compared, fp32 tolerance);
`matchmaking_failures` counts rounds run again because no group formed. The last stdout line is
{"hivemind_s", "peers", "mb", "group_size_reached", ...} or {"error": ...}; every worker (and its
DHT / averager subprocesses and p2pd daemon) is killed on exit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hivemind_anchor import kill_tree  # noqa: E402  (stdlib only)

# A round in which no peer formed a group ("Unable to run All-Reduce": hivemind's matchmaking
# gave up, once in the WAN lab) averaged nothing; it is run again, this many times at most.
MATCHMAKING_RETRIES = 2

P2P_KWARGS = dict(
    host_maddrs=["/ip4/127.0.0.1/tcp/0"],
    use_relay=False,
    use_auto_relay=False,
    auto_nat=False,
    nat_port_map=False,
    use_ipfs=False,
)


def _emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def _tensors(index: int, mb: int):
    import torch

    numel = mb * 1_000_000 // 4
    sizes = [numel // 4] * 3
    sizes += [4096] * ((numel - sum(sizes)) // 4096)
    sizes.append(numel - sum(sizes))
    g = torch.Generator().manual_seed(index)
    return [torch.randn(n, generator=g) for n in sizes if n]


def worker(index: int, peers: int, mb: int, initial: list[str], a: argparse.Namespace) -> None:
    import torch
    from hivemind import DHT
    from hivemind.averaging import DecentralizedAverager
    from hivemind.averaging.control import AveragingStage

    torch.set_num_threads(1)
    tensors = _tensors(index, mb)
    initial_sum = sum(float(t.double().sum()) for t in tensors)
    kwargs = {**P2P_KWARGS, "host_maddrs": [f"/ip4/{a.host}/tcp/0"]}
    dht = DHT(initial_peers=initial or None, start=True, **kwargs)
    averager = None
    try:
        if not initial:
            _emit({"maddrs": [str(m) for m in dht.get_visible_maddrs()]})
        averager = DecentralizedAverager(
            tensors,
            dht,
            start=True,
            prefix="meshtrain_bench",
            target_group_size=peers,
            min_group_size=peers,
            min_matchmaking_time=a.matchmaking_time,
            request_timeout=a.request_timeout,
            allreduce_timeout=a.allreduce_timeout,
        )
        del tensors  # the averager holds them (moved to shared memory)
        _emit({"ready": index, "sum": initial_sum})
        for line in sys.stdin:  # {"round": r, "at": common scheduled_time} or {"quit": true}
            cmd = json.loads(line)
            if "round" not in cmd:
                break
            t_step = time.time()
            control = averager.step(
                scheduled_time=cmd["at"], require_trigger=True, wait=False, timeout=cmd["at"] - t_step + a.group_timeout
            )
            while control.stage in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP) and not control.done():
                time.sleep(0.002)
            t_trigger = time.time()
            if not control.done():
                control.allow_allreduce()
            try:
                group = control.result(timeout=a.allreduce_timeout + a.group_timeout)
                t_done = time.time()
                with averager.get_tensors() as averaged:
                    total = sum(float(t.double().sum()) for t in averaged)
                _emit(
                    {
                        "round": cmd["round"],
                        "index": index,
                        "t_step": t_step,
                        "t_trigger": t_trigger,
                        "t_done": t_done,
                        "group": len(group or {}),
                        "sum": total,
                    }
                )
            except Exception as e:
                _emit({"round": cmd["round"], "index": index, "error": f"{type(e).__name__}: {e}"[:300]})
    finally:
        if averager is not None:
            averager.shutdown()
        dht.shutdown()


class Swarm:
    """The worker processes, their stdout lines on one queue, their stderr in temp files."""

    def __init__(self, base: list[str], lab: dict | None = None):
        self.base, self.lab, self.procs, self.errs = base, lab, [], []
        self.lines: queue.Queue = queue.Queue()

    def spawn(self, index: int, initial: list[str]) -> None:
        err = tempfile.TemporaryFile("w+")  # noqa: SIM115  (an unread stderr pipe could stall a worker)
        where = ["ip", "netns", "exec", self.lab["netns"][index]] if self.lab else []
        host = self.lab["hosts"][index] if self.lab else "127.0.0.1"
        proc = subprocess.Popen(
            [*where, *self.base, "--worker", str(index), "--initial", json.dumps(initial), "--host", host],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        self.procs.append(proc)
        self.errs.append(err)

        def pump() -> None:
            for line in proc.stdout:
                if line.startswith("{"):
                    with contextlib.suppress(json.JSONDecodeError):
                        self.lines.put((index, json.loads(line)))
            self.lines.put((index, {"exited": proc.wait()}))

        threading.Thread(target=pump, daemon=True).start()

    def collect(self, key: str, count: int, deadline: float, what: str) -> dict[int, dict]:
        got: dict[int, dict] = {}
        while len(got) < count:
            try:
                index, msg = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise TimeoutError(f"{what}: {len(got)}/{count} peers within the time limit") from None
            if "exited" in msg:
                raise RuntimeError(f"worker {index} exited ({msg['exited']}) {what}: {self.stderr_tail(index)}")
            if key in msg:
                got[index] = msg
        return got

    def send(self, obj: dict) -> None:
        for proc in self.procs:
            try:
                proc.stdin.write(json.dumps(obj) + "\n")
                proc.stdin.flush()
            except OSError:
                pass

    def stderr_tail(self, index: int) -> str:
        try:
            self.errs[index].seek(0)
            lines = [x.strip() for x in self.errs[index].read().splitlines() if x.strip()]
        except Exception:
            return ""
        hits = [x for x in lines if "Error" in x or "Exception" in x] or lines
        return hits[-1][:200] if hits else ""

    def close(self, grace: float) -> None:
        self.send({"quit": True})
        end = time.monotonic() + grace
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(end - time.monotonic(), 0.01))
        for proc in self.procs:  # whatever is left: the workers, their DHT/averager children, p2pd
            if proc.poll() is None:
                kill_tree(proc.pid)
                proc.wait()


def run(a: argparse.Namespace) -> dict:
    t_start = time.monotonic()
    limit = t_start + a.timeout
    base = [
        sys.executable,
        os.path.abspath(__file__),
        "--peers",
        str(a.peers),
        "--mb",
        str(a.mb),
        "--matchmaking-time",
        str(a.matchmaking_time),
        "--request-timeout",
        str(a.request_timeout),
        "--allreduce-timeout",
        str(a.allreduce_timeout),
        "--group-timeout",
        str(a.group_timeout),
    ]
    lab = None
    if a.lab:
        with open(a.lab) as f:
            lab = json.load(f)
        if len(lab.get("netns", [])) < a.peers or len(lab.get("hosts", [])) < a.peers:
            raise ValueError(f"--lab {a.lab}: needs a netns and a host address for each of {a.peers} peers")
    swarm = Swarm(base, lab)
    finished = False
    try:
        swarm.spawn(0, [])
        first = swarm.collect("maddrs", 1, min(limit, time.monotonic() + 120), "starting the first DHT")
        initial = first[0]["maddrs"]
        for i in range(1, a.peers):
            swarm.spawn(i, initial)
        ready = swarm.collect(
            "ready", a.peers, min(limit, time.monotonic() + 60 + 15 * a.peers), "starting DHT + averager"
        )
        expected = statistics.fmean(m["sum"] for m in ready.values())  # what every peer should end with
        deviation = 0.0
        startup_s = time.monotonic() - t_start
        time.sleep(a.warmup)  # let every peer's DHT routing table fill before matchmaking
        rounds, matchmaking_failures = [], 0
        for r in range(a.rounds):
            for attempt in range(MATCHMAKING_RETRIES + 1):
                released = time.time()
                swarm.send({"round": r, "at": released + a.matchmaking_time})
                rows = swarm.collect("round", a.peers, limit, f"finishing round {r}")
                bad = [m for m in rows.values() if "error" in m]
                # Every peer failed to form the group: nothing was averaged, so the round can be
                # run again as it was, as a hivemind user would (counted in the result).
                unmatched = len(bad) == a.peers and all("Matchmaking" in m["error"] for m in bad)
                if not (unmatched and attempt < MATCHMAKING_RETRIES):
                    break
                matchmaking_failures += 1
            if bad:
                raise RuntimeError(f"round {r}: {len(bad)} peers failed, e.g. {bad[0]['error']}")
            rows = list(rows.values())
            deviation = max(deviation, max(abs(m["sum"] - expected) for m in rows))
            last_trigger = max(m["t_trigger"] for m in rows)
            rounds.append(
                {
                    "allreduce_s": max(m["t_done"] for m in rows) - last_trigger,
                    "per_peer_max_s": max(m["t_done"] - m["t_trigger"] for m in rows),
                    "step_s": max(m["t_done"] - m["t_step"] for m in rows),
                    "matchmaking_s": last_trigger - released,
                    "group": min(m["group"] for m in rows),
                }
            )
        finished = True
        med = lambda k: round(statistics.median(x[k] for x in rounds), 3)  # noqa: E731
        return {
            "hivemind_s": med("allreduce_s"),
            "peers": a.peers,
            "mb": a.mb,
            "group_size_reached": min(x["group"] for x in rounds),
            "per_peer_max_s": med("per_peer_max_s"),
            "step_s": med("step_s"),
            "matchmaking_s": med("matchmaking_s"),
            "rounds_s": [round(x["allreduce_s"], 3) for x in rounds],
            "results_agree": deviation <= 1e-6 * a.mb * 250_000,  # |sum error| vs 1e-6 per float
            "max_sum_deviation": deviation,
            "startup_s": round(startup_s, 1),
            "matchmaking_failures": matchmaking_failures,  # rounds run again: no group formed
            "method": f"DecentralizedAverager.step(), target_group_size={a.peers}, last trigger -> last done, "
            f"median of {a.rounds} round(s)",
            "where": "wan lab" if lab else "loopback",
        }
    finally:
        swarm.close(grace=15 if finished else 0)  # on failure or SIGTERM, kill at once


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peers", type=int, default=8)
    p.add_argument("--mb", type=int, default=100)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1000, help="wall-clock limit for the whole probe (s)")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds between all peers up and round 1")
    p.add_argument("--matchmaking-time", type=float, default=5.0, help="hivemind min_matchmaking_time")
    p.add_argument("--request-timeout", type=float, default=3.0, help="hivemind request_timeout")
    p.add_argument("--group-timeout", type=float, default=60.0, help="step() timeout after scheduled time")
    p.add_argument("--allreduce-timeout", type=float, default=600.0)
    p.add_argument("--lab", default="", help='JSON file {"netns": [...], "hosts": [...]}: run peer i in the WAN lab')
    p.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    p.add_argument("--worker", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--initial", default="[]", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker >= 0:
        worker(a.worker, a.peers, a.mb, json.loads(a.initial), a)
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the workers are killed on the way out
    try:
        result = run(a)
    except Exception as e:
        result = {"error": " ".join(f"{type(e).__name__}: {e}".split())[:300], "peers": a.peers, "mb": a.mb}
    _emit(result)


if __name__ == "__main__":
    main()
