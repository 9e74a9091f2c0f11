"""Start-up benchmark: a node preparing a large corpus answers its status page and Ctrl-C, and a
restart on the same data does not prepare it again.

    python scripts/bench/bench_startup.py [--gb 1.0]

A text corpus of `--gb` GB is written here (English-like lines from the built-in corpus, repeated
with a counter so no two lines are equal). A swarm of gpt-tiny on it (bytes tokenizer) is created
(`swarm create` digests it once to pin it), and:

1. `node start`; once `/status` says it is tokenising (`training.waiting`), SIGINT. The time from
   the signal to the process's exit is `startup_ctrl_c_s` (target <= 1: the real-scale issue's).
   `waiting_seen` is what the status page said while tokenising.
2. `node start` again, left to tokenise the rest of the corpus (the shards the interrupted start
   finished are kept) and train its first step, then stopped: `first_prepare_s`, from the start to
   state "training".
3. `node start` a third time: `restart_prepare_s`, the same (target <= 5: the digest and the
   token cache are reused, node/daemon.py and meshtrain/data/).

Last line: one JSON object with those figures and the corpus size.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.bench.harness import Daemon, create_swarm, emit, wait_for  # noqa: E402


def write_corpus(path: Path, size: int) -> int:
    """About `size` bytes of text lines; the bytes written."""
    from pydoc_data.topics import topics

    lines = [line for text in topics.values() for line in text.splitlines() if line.strip()]
    written, i = 0, 0
    with open(path, "w") as f:
        while written < size:
            chunk = "".join(f"{i + j} {lines[(i + j) % len(lines)]}\n" for j in range(10_000))
            f.write(chunk)
            written += len(chunk.encode())
            i += 10_000
    return written


def state_of(d: Daemon) -> tuple[str, str]:
    doc = d.status()
    if doc is None:
        return "", ""
    return doc["node"]["state"], doc["training"].get("waiting") or ""


def time_to_training(work: Path, data_dir: Path, name: str) -> float:
    """Start the node, wait until it trains, stop it; seconds from start to training."""
    t0 = time.monotonic()
    d = Daemon(data_dir, work / f"{name}.log", "--swarm", str(data_dir / "swarm.json"))
    try:
        d.daemon(timeout=600)
        wait_for(lambda: state_of(d)[0] == "training", 3600, f"{name}: state training", poll=0.1)
        took = time.monotonic() - t0
        d.interrupt()
        d.wait(120)
        return took
    finally:
        d.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=1.0, help="corpus size in GB (default 1)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_startup_"))
    try:
        corpus = work / "corpus.txt"
        size = write_corpus(corpus, int(args.gb * 1e9))
        data_dir = work / "node"
        create_swarm(data_dir, "--model", "gpt-tiny", "--dataset", str(corpus), "--steps", "0", "--eval-every", "0")
        d = Daemon(data_dir, work / "interrupted.log", "--swarm", str(data_dir / "swarm.json"))
        try:
            d.daemon(timeout=600)
            seen = wait_for(
                lambda: (w := state_of(d)[1]).startswith("preparing: tokenising") and w,
                600,
                "the node to tokenise",
                poll=0.1,
            )
            t0 = time.monotonic()
            d.p.send_signal(signal.SIGINT)
            d.p.wait(timeout=120)
            ctrl_c = time.monotonic() - t0
            exit_code = d.p.returncode
        finally:
            d.kill()
        first = time_to_training(work, data_dir, "first")
        again = time_to_training(work, data_dir, "restart")
        emit(
            {
                "corpus_bytes": size,
                "startup_ctrl_c_s": round(ctrl_c, 2),
                "ctrl_c_exit_code": exit_code,
                "waiting_seen": seen,
                "first_prepare_s": round(first, 1),
                "restart_prepare_s": round(again, 2),
                "targets": {"startup_ctrl_c_s": 1.0, "restart_prepare_s": 5.0},
                "targets_met": ctrl_c <= 1.0 and again <= 5.0,
            }
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
