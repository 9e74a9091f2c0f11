"""`meshtrain node stop` and `node status` on a machine busy training: real nodes on loopback.

    python scripts/bench/bench_stop.py [--busy N] [--repeats 5] [--model gpt-small]

In the chaos soak, `meshtrain node stop` took 15-16 s to return under load: the command imported
torch and libp2p (through the config model) before it sent one byte. This benchmark recreates
that load — two nodes training one swarm together (DiLoCo, H = 20, no step limit) plus `--busy`
processes spinning on the cores (default: one per core) — and times the commands as a user runs
them, start of the process to its exit:

- `status_s_p50`, `status_s_max`: `meshtrain node status`, `--repeats` times; of which
  `status_http_s_p50` is the node answering (GET /status from a warm process) and
  `cli_startup_s_p50` starting Python and importing the CLI (the floor on a loaded machine);
- `stop_s`: `meshtrain node stop` on node a (target: under 1 s); `stop_to_exit_s`: until node a's
  process has exited (it leaves the swarm and checkpoints in the background);
- `stop_wait_s`: `meshtrain node stop --wait` on node b, which returns once b has exited;
- `status_no_node_s_p50`, `stop_no_node_s_p50`: both commands once no node runs (one line, exit
  code 1), `--repeats` times, the cores still busy (target: under 0.3 s; they import nothing
  heavy on that path either).

It checks what it times: both stop commands exit 0, both nodes exit 0, print their JSON result
last, hold a checkpoint at their final step and remove daemon.json (`clean_exits`, 2 of 2). One
JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from meshtrain.node.state.checkpoint import CheckpointStore
from meshtrain.node.status.client import fetch_status

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.bench.harness import Daemon, cli, create_swarm, emit  # noqa: E402


def timed_cli(*args: str) -> tuple[float, subprocess.CompletedProcess]:
    """`meshtrain <args>` and how long it took, start-up included (what a user waits)."""
    t0 = time.monotonic()
    r = cli(*args)
    return time.monotonic() - t0, r


def clean_exit(node: Daemon) -> bool:
    result = node.wait(timeout=120)
    if result is None:
        return False
    data_dir = node.dir
    ck = CheckpointStore(data_dir / "checkpoints").load_latest()
    return (
        bool(result.get("checkpoint"))
        and ck is not None
        and ck.step == result["step"]
        and not (data_dir / "daemon.json").exists()
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--busy", type=int, default=os.cpu_count() or 2, help="spinning processes (default: cores)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", default="gpt-small")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="meshtrain-bench-stop-"))
    a, b = tmp / "a", tmp / "b"
    create_swarm(a, "--model", args.model, "--steps", "0", "--H", "20", "--eval-every", "50")
    na = Daemon(a, tmp / "a.log", "--wait-peers", "2")
    info = na.daemon()
    nb = Daemon(b, tmp / "b.log", "--join", info["addrs"][0], "--wait-peers", "2")
    nb.daemon()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        deadline = time.monotonic() + 120
        while True:  # both train, and have done at least one round together
            _, r = timed_cli("node", "status", "--data-dir", str(a), "--json")
            st = json.loads(r.stdout) if r.returncode == 0 else None
            if st and len(st["peers"]) == 2 and st["training"]["round"] >= 1:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"the swarm did not start training; logs in {tmp}")
            time.sleep(0.5)
        status_s, http_s, startup_s = [], [], []
        for _ in range(args.repeats):
            dt, r = timed_cli("node", "status", "--data-dir", str(a))
            if r.returncode:
                raise SystemExit(r.stderr)
            status_s.append(dt)
            t0 = time.monotonic()
            fetch_status(info["status_url"])
            http_s.append(time.monotonic() - t0)
            t0 = time.monotonic()
            subprocess.run([sys.executable, "-c", "import meshtrain.node.cli"], cwd=ROOT, check=True)
            startup_s.append(time.monotonic() - t0)
        t0 = time.monotonic()
        stop_s, ra = timed_cli("node", "stop", "--data-dir", str(a))
        na.p.wait(timeout=120)
        stop_to_exit_s = time.monotonic() - t0
        stop_wait_s, rb = timed_cli("node", "stop", "--data-dir", str(b), "--wait")
        no_node = {}  # both nodes gone, the cores still busy: the error path, as a user meets it
        for action in ("status", "stop"):
            runs = [timed_cli("node", action, "--data-dir", str(a)) for _ in range(args.repeats)]
            if any(r.returncode != 1 or len(r.stderr.strip().splitlines()) != 1 for _, r in runs):
                raise SystemExit(f"node {action} with no node running: not one line and exit code 1")
            no_node[action] = statistics.median(dt for dt, _ in runs)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    clean = sum([ra.returncode == 0 and clean_exit(na), rb.returncode == 0 and clean_exit(nb)])
    emit(
        {
            "busy_processes": args.busy,
            "cores": os.cpu_count(),
            "model": args.model,
            "status_s_p50": round(statistics.median(status_s), 3),
            "status_s_max": round(max(status_s), 3),
            "status_http_s_p50": round(statistics.median(http_s), 3),
            "cli_startup_s_p50": round(statistics.median(startup_s), 3),
            "stop_s": round(stop_s, 3),
            "stop_to_exit_s": round(stop_to_exit_s, 3),
            "stop_wait_s": round(stop_wait_s, 3),
            "status_no_node_s_p50": round(no_node["status"], 3),
            "stop_no_node_s_p50": round(no_node["stop"], 3),
            "clean_exits": clean,
            "logs": str(tmp),
        }
    )


if __name__ == "__main__":
    main()
