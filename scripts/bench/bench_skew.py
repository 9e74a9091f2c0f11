"""Clock skew benchmark: real daemons whose wall clocks are shifted, training one swarm.

    python scripts/bench/bench_skew.py [--shifts 0,-60,60,600] [--rounds 5] [--H 10]

Each daemon after the first joins through the first one's address; its wall clock is shifted by
its entry of `--shifts` (seconds: a minute behind, a minute ahead, ten minutes ahead) with
Debian's libfaketime (`apt-get install faketime`): `LD_PRELOAD=libfaketime.so.1`, `FAKETIME=+60s`,
and `FAKETIME_DONT_FAKE_MONOTONIC=1` so that the monotonic clock — trio's, and the one liveness
is judged by (crdt/swarm_records.py) — runs true, as it does on a machine whose wall clock is
wrong. libfaketime shifts `time.time()` in Python, torch's threads and libp2p alike; no test hook
in meshtrain is needed. The swarm is gpt-tiny with DiLoCo, `--H` steps per round, trained until
every daemon completed `--rounds` rounds (then they are killed: nothing after that is measured).

One JSON object on the last line:
- `excluded` (target 0): (observer, peer) pairs where a daemon's live peers lacked another
  daemon at some status poll after every daemon had completed a round.
- `rounds_missed` (target 0): rounds 1..`--rounds`, summed over daemons, that a daemon completed
  with fewer contributors than daemons (its status history records each round's contributors).
- `max_offset_error_s`: the largest |measured − applied| clock offset, every daemon measuring
  every other (`clock_offset_s` in its status; applied: the difference of the two shifts).
- `offsets`: what the first daemon measured, peer -> seconds; `shifts`, `rounds`, `wall_s`.
(`skewed_swarm` also returns the daemons' `peers` and `logs`.)

tests/test_skew.py runs `skewed_swarm` with three daemons (0, −60 s, +10 min: every daemon
sees a peer a minute behind or ahead, and one ten minutes ahead).
"""

from __future__ import annotations

import argparse
import glob
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.bench.harness import Daemon, create_swarm, emit, wait_for  # noqa: E402

POLL_S = 0.5


def faketime_library() -> str | None:
    """Debian's libfaketime (package `faketime`), or None where it is not installed."""
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))
    return found[0] if found else None


def faketime_env(shift_s: int) -> dict[str, str]:
    """The environment that shifts a process's wall clock by `shift_s` seconds (monotonic: true)."""
    if shift_s == 0:
        return {}
    library = faketime_library()
    if library is None:
        raise RuntimeError("libfaketime is not installed (apt-get install faketime)")
    return {"LD_PRELOAD": library, "FAKETIME": f"{shift_s:+d}s", "FAKETIME_DONT_FAKE_MONOTONIC": "1"}


def skewed_swarm(work: Path, shifts: list[int], rounds: int, h: int = 10, timeout: float = 240) -> dict[str, Any]:
    """Run daemons with wall clocks shifted by `shifts` until each completed `rounds` rounds; the
    measures of the module docstring (and `logs`: each daemon's log, to read on a failure)."""
    n = len(shifts)
    dirs = [work / f"n{i}" for i in range(n)]
    logs = [work / f"n{i}.log" for i in range(n)]
    create_swarm(dirs[0], "--model", "gpt-tiny", "--steps", "0", "--H", str(h), "--eval-every", "0")
    common = ["--wait-peers", str(n)]
    t0 = time.monotonic()
    nodes = [Daemon(dirs[0], logs[0], "--swarm", str(dirs[0] / "swarm.json"), *common, env=faketime_env(shifts[0]))]
    try:
        first = nodes[0].daemon()
        nodes += [
            Daemon(dirs[i], logs[i], "--join", first["addrs"][0], *common, env=faketime_env(shifts[i]))
            for i in range(1, n)
        ]
        ids = [node.daemon()["peer_id"] for node in nodes]
        missing: set[tuple[str, str]] = set()
        offsets: dict[tuple[str, str], float] = {}
        statuses: list[dict | None] = [None] * n

        def progressed() -> bool:
            for i, node in enumerate(nodes):
                statuses[i] = node.status() or statuses[i]
                if node.p.poll() is not None:
                    raise RuntimeError(f"node {i} exited; see {logs[i]}")
            if not all(statuses):
                return False
            docs = [s for s in statuses if s is not None]
            if all(s["training"]["round"] >= 1 for s in docs):
                for i, s in enumerate(docs):
                    live = {p["peer_id"] for p in s["peers"]}
                    missing.update((ids[i], peer) for peer in ids if peer not in live)
            for i, s in enumerate(docs):
                for p in s["peers"]:
                    if p["peer_id"] != ids[i] and p.get("clock_offset_s") is not None:
                        offsets[(ids[i], p["peer_id"])] = p["clock_offset_s"]
            return all(s["training"]["round"] >= rounds for s in docs) and len(offsets) == n * (n - 1)

        wait_for(progressed, timeout, f"{n} skewed daemons to train {rounds} rounds and measure offsets", POLL_S)
    finally:
        for node in nodes:
            node.kill()
    shift_of = dict(zip(ids, shifts, strict=True))
    errors = [abs(off - (shift_of[peer] - shift_of[obs])) for (obs, peer), off in offsets.items()]
    missed = 0
    for s in statuses:
        if s is None:  # every status was read before `progressed` returned True
            raise RuntimeError("a daemon's status was never read")
        contributors: dict[int, int] = {}
        for point in s["training"]["history"]:
            r, c = point.get("round", 0), point.get("contributors")
            if 1 <= r <= rounds and c is not None:
                contributors[r] = min(c, contributors.get(r, c))
        missed += sum(1 for r in range(1, rounds + 1) if contributors.get(r, 0) < n)
    return {
        "excluded": len(missing),
        "rounds_missed": missed,
        "max_offset_error_s": round(max(errors), 3),
        "offsets": {peer[-8:]: off for (obs, peer), off in offsets.items() if obs == ids[0]},
        "shifts": shifts,
        "rounds": rounds,
        "wall_s": round(time.monotonic() - t0, 1),
        "peers": ids,
        "logs": [str(p) for p in logs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shifts", default="0,-60,60,600", help="seconds each daemon's wall clock is shifted by")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--H", type=int, default=10, help="inner steps per round")
    args = ap.parse_args()
    if faketime_library() is None:
        sys.exit("bench_skew needs libfaketime: apt-get install faketime")
    with tempfile.TemporaryDirectory() as tmp:
        result = skewed_swarm(Path(tmp), [int(s) for s in args.shifts.split(",")], args.rounds, args.H)
    for key in ("peers", "logs"):  # where this run's daemons were: gone with their directory
        result.pop(key)
    emit(result)


if __name__ == "__main__":
    main()
