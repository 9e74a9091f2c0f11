"""Node benchmark: real `meshtrain` node processes on loopback, driven through the CLI.

    python scripts/bench/bench_node.py [--quick]

Three phases, one JSON object on the last line:

1. **Swarm, crash and restart** — 4 nodes train gpt-small with DiLoCo; node 3 is killed with
   SIGKILL mid-run and restarted with the same data dir: it must resume from its last checkpoint
   (digest-verified) and finish with the swarm (`restart_resume_ok`). `loss_start` / `loss_end`:
   node 0's held-out loss at the first evaluation and at the end.
2. **Late joiner** — 3 nodes train a model of >= 25M parameters (gpt-large); a 4th joins late
   and downloads the current outer state from all 3 in parallel (`join_sync_s`), then a 5th
   joins with `--max-donors 1` (`single_donor_sync_s`, the same state size from one donor, same
   run). Donors cap their upload (`--donor-upload-mib`, default 40 MiB/s per donor: a volunteer's
   uplink; on one 2-core machine an uncapped loopback transfer is CPU-bound and one donor or three
   would tie for reasons unrelated to the network). Target: join_sync_s <= 0.7 × single.
3. **Crash consistency** — a node checkpointing every 0.2 s is killed with SIGKILL at a random
   moment, 20 times (`--kills`); afterwards every checkpoint on disk must verify
   (`checkpoint_corrupt_count`, target 0) and the node must resume from the latest.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from meshtrain.node.state.checkpoint import CheckpointError, CheckpointStore

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.bench.harness import Daemon, create_swarm, emit, wait_for  # noqa: E402


def phase_restart(work: Path, steps: int) -> dict:
    dirs = [work / f"r{i}" for i in range(4)]
    logs = [work / f"r{i}.log" for i in range(4)]
    create_swarm(dirs[0], "--model", "gpt-small", "--H", "25", "--steps", str(steps), "--eval-every", "25")
    nodes = [
        Daemon(dirs[0], logs[0], "--swarm", str(dirs[0] / "swarm.json"), "--wait-peers", "4", "--checkpoint-every", "2")
    ]
    first = nodes[0].daemon()
    nodes += [
        Daemon(dirs[i], logs[i], "--join", first["addrs"][0], "--wait-peers", "4", "--checkpoint-every", "2")
        for i in range(1, 4)
    ]
    for n in nodes:
        n.daemon()
    t0 = time.monotonic()
    # Kill node 3 once it has a checkpoint and is past a third of the run.
    wait_for(
        lambda: (s := nodes[3].status()) and s["training"]["step"] >= steps // 3 and s["checkpoint"]["last_step"],
        300,
        "node 3 to checkpoint",
    )
    nodes[3].kill()
    saved = CheckpointStore(dirs[3] / "checkpoints").load_latest()
    killed_at = saved.step if saved else None
    time.sleep(1.0)
    restarted = Daemon(dirs[3], logs[3])
    results = [n.wait(600) for n in nodes[:3]] + [restarted.wait(600)]
    log3 = logs[3].read_text()
    resumed = f"resumed from checkpoint step={killed_at}" in log3
    history = json.loads((dirs[0] / "history.json").read_text())
    evals = [(r["step"], r["eval_loss"]) for r in history if r.get("eval_loss") is not None]
    return {
        "restart_resume_ok": bool(
            resumed and results[3] and results[3]["step"] == steps and all(r and r["step"] == steps for r in results)
        ),
        "restart_killed_at_step": killed_at,
        "restart_rejoined_by": "download" if "joined the swarm" in log3 else "resume",
        "loss_start": round(evals[0][1], 4) if evals else None,
        "loss_end": round(results[0]["eval_loss"], 4) if results[0] and results[0]["eval_loss"] else None,
        "swarm_wall_s": round(time.monotonic() - t0, 1),
    }


def phase_join(work: Path, upload_mib: float) -> dict:
    dirs = [work / f"j{i}" for i in range(5)]
    logs = [work / f"j{i}.log" for i in range(5)]
    create_swarm(dirs[0], "--model", "gpt-large", "--H", "2", "--steps", "0", "--batch-size", "1", "--eval-every", "0")
    limit = ["--donor-upload-mib", str(upload_mib)]
    donors = [Daemon(dirs[0], logs[0], "--swarm", str(dirs[0] / "swarm.json"), "--wait-peers", "3", *limit)]
    first = donors[0].daemon()
    donors += [Daemon(dirs[i], logs[i], "--join", first["addrs"][0], "--wait-peers", "3", *limit) for i in (1, 2)]
    for d in donors:
        d.daemon()
    wait_for(lambda: (s := donors[0].status()) and s["training"]["round"] >= 1, 600, "the first round")
    out: dict = {}
    for name, extra in (("join_sync_s", []), ("single_donor_sync_s", ["--max-donors", "1"])):
        i = 3 if name == "join_sync_s" else 4
        joiner = Daemon(dirs[i], logs[i], "--join", first["addrs"][0], *extra)
        st = wait_for(lambda j=joiner: (s := j.status()) and s.get("joined_from") and s, 600, f"{name} joiner")
        out[name] = round(st["joined_from"]["seconds"], 3)
        out[name.replace("_s", "_donors")] = st["joined_from"]["donors"]
        out["state_mib"] = round(st["joined_from"]["bytes"] / 2**20, 1)
        joiner.interrupt()
        joiner.wait(60)
    for d in donors:
        d.interrupt()
    for d in donors:
        d.wait(60)
    out["join_vs_single"] = round(out["join_sync_s"] / out["single_donor_sync_s"], 3)
    out["params"] = "gpt-large (25.4M)"
    return out


def phase_crash(work: Path, kills: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    d, log = work / "crash", work / "crash.log"
    create_swarm(d, "--model", "gpt-small", "--H", "10", "--steps", "0", "--eval-every", "0")
    corrupt = 0
    for _ in range(kills):
        n = Daemon(d, log, "--checkpoint-every", "0.2")
        n.daemon()
        time.sleep(rng.uniform(0.3, 2.0))
        n.kill()
        store = CheckpointStore(d / "checkpoints")
        for path in store.list():
            try:
                store.load(path)
            except CheckpointError:
                corrupt += 1
    latest = CheckpointStore(d / "checkpoints").load_latest()
    return {
        "checkpoint_corrupt_count": corrupt,
        "checkpoint_kills": kills,
        "checkpoint_latest_step": latest.step if latest else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--kills", type=int, default=None)
    ap.add_argument("--donor-upload-mib", type=float, default=40.0)
    ap.add_argument("--phases", default="restart,join,crash")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-node-"))
    result: dict = {"quick": args.quick}
    t0 = time.monotonic()
    try:
        phases = args.phases.split(",")
        if "restart" in phases:
            result.update(phase_restart(work, 150 if args.quick else 400))
            print(json.dumps({"phase": "restart", **result}), file=sys.stderr, flush=True)
        if "join" in phases:
            result.update(phase_join(work, args.donor_upload_mib))
            print(json.dumps({"phase": "join", **result}), file=sys.stderr, flush=True)
        if "crash" in phases:
            result.update(phase_crash(work, args.kills or (5 if args.quick else 20)))
    finally:
        result["wall_s"] = round(time.monotonic() - t0, 1)
        shutil.rmtree(work, ignore_errors=True)
    if "join_sync_s" in result:
        result["targets_met"] = {
            "join_sync": result["join_vs_single"] <= 0.7,
            "corrupt": result.get("checkpoint_corrupt_count") == 0,
        }
    emit(result)


if __name__ == "__main__":
    main()
