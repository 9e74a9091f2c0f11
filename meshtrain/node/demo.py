"""`meshtrain demo`: a real local swarm — N node processes on loopback — training the small GPT on
the built-in corpus, with a live table, a loss plot and a summary.

`--pipeline`: a pipeline swarm instead (6 nodes, 3 stages, SkipPipe; node/stages/peer.py): the
table shows each node's stage and the stage map, the plot the training loss per iteration.

Nothing is simulated: the demo does what a user would do by hand. It writes a swarm spec
(`meshtrain swarm create`), starts the first node with it (`meshtrain node start`), starts the
others with `meshtrain swarm join <first node's address>` (each fetches and verifies the spec),
and watches every node through its status endpoint (`/status`, as `meshtrain node status`
does). The nodes' data dirs, logs, the plot (`loss.png`) and `summary.json` land in `--out`.
Ctrl-C stops every node cleanly (they leave the swarm and checkpoint).

`--optimizer` offers `DEMO_OPTIMIZERS`, read from `meshtrain.optim.BUILTIN_OPTIMIZERS`: every
built-in outer optimizer whose round spans H inner steps (all but dp); the flags themselves are
node/cli.py's (`_demo_flags`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from meshtrain.errors import ConfigError, MeshtrainError
from meshtrain.node.spec.data_dir import make_writable_dir
from meshtrain.node.status.client import DAEMON_FILE
from meshtrain.optim import BUILTIN_OPTIMIZERS

STARTUP_TIMEOUT = 60.0
# `--optimizer`: the built-in outer optimizers but dp, whose round is every inner step (H = 1)
# where the demo's swarm trains `--H` steps between rounds.
DEMO_OPTIMIZERS = tuple(name for name in BUILTIN_OPTIMIZERS if name != "dp")


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "meshtrain.node.cli", *args]


class _Swarm:
    """The demo's node processes and what they said."""

    def __init__(self, out: Path, n: int) -> None:
        self.out, self.n = out, n
        self.procs: list[subprocess.Popen] = []
        self.dirs = [out / "nodes" / f"node{i}" for i in range(n)]
        self.logs: list[Path] = []
        self.urls: list[str | None] = [None] * n
        self.stage_map: list[list[str]] | None = None  # a running epoch's placement, as last seen

    def start(self, i: int, extra: list[str]) -> None:
        log = self.out / f"node{i}.log"
        self.logs.append(log)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        with open(log, "w") as err:
            self.procs.append(
                subprocess.Popen(
                    _cli(
                        "node",
                        "start",
                        "--data-dir",
                        str(self.dirs[i]),
                        "--listen",
                        "/ip4/127.0.0.1/tcp/0",
                        "--status-port",
                        "0",
                        "--threads",
                        "1",
                        "--checkpoint-every",
                        "30",
                        "--name",
                        f"node{i}",
                        "--wait-peers",
                        str(self.n),
                        *extra,
                    ),
                    stdout=subprocess.PIPE,
                    stderr=err,
                    text=True,
                    env=env,
                    start_new_session=True,
                )
            )

    def wait_daemon(self, i: int) -> dict[str, Any]:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        path = self.dirs[i] / DAEMON_FILE
        while time.monotonic() < deadline:
            if self.procs[i].poll() is not None:
                raise MeshtrainError(
                    f"node{i} exited at start-up; its log ({self.logs[i]}) ends:\n" + _tail(self.logs[i])
                )
            try:
                info = json.loads(path.read_text())
                self.urls[i] = info.get("status_url")
                return info
            except (OSError, ValueError):
                time.sleep(0.1)
        raise MeshtrainError(f"node{i} did not start within {STARTUP_TIMEOUT:.0f} s; see {self.logs[i]}")

    def statuses(self) -> list[dict | None]:
        from meshtrain.node.status.client import fetch_status

        out: list[dict | None] = []
        for url, p in zip(self.urls, self.procs, strict=False):
            if url is None or p.poll() is not None:
                out.append(None)
                continue
            try:
                out.append(fetch_status(url, timeout=2))
            except MeshtrainError:
                out.append(None)
        self.stage_map = _stage_map(out, in_epoch=True) or self.stage_map
        return out

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 15
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def results(self) -> list[dict | None]:
        res = []
        for p in self.procs:
            last = None
            if p.stdout is not None:
                for line in p.stdout.read().splitlines():
                    with contextlib.suppress(ValueError):
                        last = json.loads(line)
            res.append(last)
        return res


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text().splitlines()[-n:])
    except OSError:
        return "(no log)"


def _stage_of(st: dict) -> str:
    """A pipeline node's stage, for the table ("" outside pipeline swarms)."""
    stage = (st.get("pipeline") or {}).get("stage")
    return "" if stage is None else str(stage)


def _stage_map(statuses: list[dict | None], in_epoch: bool = False) -> list[list[str]] | None:
    """The stage map (short peer ids per stage) as the first live pipeline node sees it; with
    `in_epoch`, only a running epoch's placement (a node between epochs, or done while others
    finish, shows what the members still announce: part of the swarm)."""
    for st in statuses:
        pipe = (st or {}).get("pipeline")
        if pipe and any(pipe["stage_map"]) and (pipe["epoch"] is not None or not in_epoch):
            return [[p[-6:] for p in peers] for peers in pipe["stage_map"]]
    return None


def _table(statuses: list[dict | None], started: float, steps: int) -> Any:
    from rich.table import Table

    stages = _stage_map(statuses)
    title = f"meshtrain demo — {len(statuses)} nodes, {time.monotonic() - started:.0f} s"
    if stages is not None:
        title += " — stages " + "  ".join(f"{s}: {','.join(ps) or '(empty)'}" for s, ps in enumerate(stages))
    t = Table(title=title, expand=False)
    cols = ["node", "peer", "state", "step", "round", "loss", "eval loss", "sent MiB", "recv MiB", "peers"]
    if stages is not None:
        cols.insert(3, "stage")
    for col in cols:
        t.add_column(col, justify="right" if col not in ("peer", "state", "node") else "left")
    for i, st in enumerate(statuses):
        if st is None:
            t.add_row(f"node{i}", "", "[dim]down/finished[/dim]", *[""] * (len(cols) - 3))
            continue
        n, tr = st["node"], st["training"]
        row = [
            f"node{i}",
            n["peer_id"][-8:],
            n["state"],
            f"{tr['step']}/{steps}",
            str(tr["round"]),
            "-" if tr["loss"] is None else f"{tr['loss']:.3f}",
            "-" if tr["eval_loss"] is None else f"{tr['eval_loss']:.3f}",
            f"{tr['bytes_sent'] / 2**20:.2f}",
            f"{tr['bytes_received'] / 2**20:.2f}",
            str(len(st["peers"])),
        ]
        if stages is not None:
            row.insert(3, _stage_of(st))
        t.add_row(*row)
    return t


def _pipeline_flags(args: argparse.Namespace) -> list[str]:
    """`swarm create` flags of `demo --pipeline`: SkipPipe on `--stages` stages."""
    if not args.pipeline:
        return []
    return [
        "--pipeline",
        "skippipe",
        "--stages",
        str(args.stages),
        "--skip-ratio",
        str(args.skip_ratio),
        "--microbatches",
        str(args.nodes),
        "--batch-size",
        "8",
        "--replica-sync",
        args.replica_sync,
    ]


def run_demo(args: argparse.Namespace) -> int:
    if args.nodes is None:
        args.nodes = 6 if args.pipeline else 4
    if not 1 <= args.nodes <= 16:
        raise ConfigError("--nodes must be between 1 and 16 on one machine")
    if args.pipeline and not 2 <= args.stages <= min(args.nodes, 5):
        raise ConfigError(f"--stages must be between 2 and {min(args.nodes, 5)} (gpt-small has 4 blocks; a node each)")
    steps = args.steps if args.steps is not None else (60 if args.quick else 600)
    H = args.H if args.H is not None else (10 if args.pipeline else 20 if args.quick else 50)
    if steps < 1 or H < 1:
        raise ConfigError("--steps and --H must be at least 1")
    out = Path(args.out)
    if (out / "nodes").exists():
        shutil.rmtree(out / "nodes")
    make_writable_dir(out, "the demo's directory", "--out")
    swarm = _Swarm(out, args.nodes)
    created = subprocess.run(
        _cli(
            "swarm",
            "create",
            "--data-dir",
            str(swarm.dirs[0]),
            "--model",
            "gpt-small",
            "--optimizer",
            args.optimizer,
            "--H",
            str(H),
            "--steps",
            str(steps),
            "--eval-every",
            str(max(H // 2, 10)),
            "--name",
            "meshtrain-demo",
            *(["--fragments", "2", "--codec", "fp4"] if args.optimizer == "streaming" else []),
            *_pipeline_flags(args),
        ),
        capture_output=True,
        text=True,
    )
    if created.returncode:
        raise MeshtrainError(f"swarm create failed: {created.stderr.strip()}")
    swarm_id = json.loads(created.stdout.splitlines()[0])["swarm_id"]
    say = print if args.plain else (lambda *a: print(*a, file=sys.stderr))
    what = f"skippipe on {args.stages} stages, replica sync {args.replica_sync}" if args.pipeline else args.optimizer
    say(f"swarm {swarm_id}: {args.nodes} nodes, gpt-small, {what}, H={H}, {steps} steps; files in {out}")
    started = time.monotonic()
    interrupted = False
    try:
        swarm.start(0, ["--swarm", str(swarm.dirs[0] / "swarm.json")])
        first = swarm.wait_daemon(0)
        for i in range(1, args.nodes):
            swarm.start(i, ["--join", first["addrs"][0]])
        for i in range(1, args.nodes):
            swarm.wait_daemon(i)
        last_line = 0.0
        if args.plain or not sys.stdout.isatty():
            while swarm.running():
                if time.monotonic() - last_line >= 5:
                    last_line = time.monotonic()
                    for i, st in enumerate(swarm.statuses()):
                        if st is not None:
                            tr = st["training"]
                            print(
                                json.dumps(
                                    {
                                        "node": i,
                                        "state": st["node"]["state"],
                                        "stage": (st.get("pipeline") or {}).get("stage"),
                                        "step": tr["step"],
                                        "round": tr["round"],
                                        "loss": tr["loss"],
                                        "eval_loss": tr["eval_loss"],
                                        "bytes_sent": tr["bytes_sent"],
                                    }
                                ),
                                flush=True,
                            )
                time.sleep(0.5)
        else:
            from rich.live import Live

            with Live(_table(swarm.statuses(), started, steps), refresh_per_second=2) as live:
                histories: list[dict | None] = []
                while swarm.running():
                    histories = swarm.statuses()
                    live.update(_table(histories, started, steps))
                    time.sleep(1.0)
    except KeyboardInterrupt:
        interrupted = True
        say("interrupted: stopping the nodes cleanly")
    finally:
        swarm.stop()
    results = swarm.results()
    return _summarise(out, swarm, results, steps, H, args, started, interrupted, swarm_id)


def _summarise(
    out: Path,
    swarm: _Swarm,
    results: list[dict | None],
    steps: int,
    H: int,
    args: argparse.Namespace,
    started: float,
    interrupted: bool,
    swarm_id: str,
) -> int:
    from meshtrain.node.status.plot import plot_curves

    # A pipeline swarm has no peer with the whole model to evaluate: its curve is the training
    # loss of each iteration (the same number on every node of the swarm).
    key = "loss" if args.pipeline else "eval_loss"
    curves: dict[str, list[tuple[float, float]]] = {}
    for i, d in enumerate(swarm.dirs):
        hist = d / "history.json"
        if hist.exists():
            rows = json.loads(hist.read_text())
            curves[f"node{i}"] = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    what = f"skippipe, {args.stages} stages, {args.replica_sync}" if args.pipeline else args.optimizer
    png = plot_curves(
        curves,
        out / "loss.png",
        title=f"meshtrain demo: {what}, {args.nodes} nodes, H={H}",
        ylabel="training loss (all microbatches)" if args.pipeline else "held-out loss (outer parameters)",
    )
    finals = [r for r in results if r]
    first = [c[0][1] for c in curves.values() if c]
    summary = {
        "swarm_id": swarm_id,
        "nodes": args.nodes,
        "optimizer": None if args.pipeline else args.optimizer,
        "pipeline": (
            {
                "stages": args.stages,
                "skip_ratio": args.skip_ratio,
                "replica_sync": args.replica_sync,
                "stage_map": swarm.stage_map,
                "loss_first": round(sum(first) / len(first), 4) if first else None,
                "loss_final": [round(c[-1][1], 4) if c else None for c in curves.values()],
            }
            if args.pipeline
            else None
        ),
        "H": H,
        "steps": steps,
        "wall_s": round(time.monotonic() - started, 1),
        "interrupted": interrupted,
        "nodes_finished": sum(1 for r in finals if r.get("step") == steps),
        "eval_loss_first": round(sum(first) / len(first), 4) if first else None,
        "eval_loss_final": [
            None if r is None or r.get("eval_loss") is None else round(r["eval_loss"], 4) for r in results
        ],
        "rounds": [None if r is None else r.get("rounds") for r in results],
        "plot": str(png),
        "logs": [str(p) for p in swarm.logs],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    ok = not interrupted and summary["nodes_finished"] == args.nodes
    print(json.dumps(summary), flush=True)
    if not ok and not interrupted:
        for i, r in enumerate(results):
            if r is None or r.get("step") != steps:
                print(f"node{i} did not finish; its log ends:\n{_tail(swarm.logs[i])}", file=sys.stderr)
    return 0 if ok or interrupted else 1
