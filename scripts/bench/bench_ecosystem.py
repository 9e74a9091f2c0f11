"""Ecosystem benchmark (issue 33's measure): meshtrain inside the training scripts people have.

    python scripts/bench/bench_ecosystem.py [--quick]

One JSON object on the last line:

- `hf_callback_phi_equal`, `hf_callback_loss_fell`: examples/hf_trainer.py (an ordinary
  `transformers.Trainer` script on a tiny local LLaMA, plus `MeshtrainCallback`) run as two real
  processes on loopback, one creating the swarm and one joining it: both end with the same φ digest
  (true), and each one's logged loss fell (mean of its last quarter below its first: true). With
  `hf_callback_rounds`, `hf_callback_contributors` (per round, as the creator saw them), the two
  runs' final losses and `hf_callback_wall_s`.
- `hf_callback_overhead`: samples/s of the same Trainer (tiny LLaMA, same data, batch, optimizer)
  without the callback over samples/s with it, on a 1-peer swarm with no round due (H beyond the
  run): what the callback and the node beside it cost per step. Timed from the end of a warm-up
  step (the swarm's join is in the warm-up) to the last step's end; a trial runs both, taking
  turns at going first, and the median of the trials' paired ratios counts (the load drifts
  between trials, less within one); torch runs `--threads` threads (1) in both. Target <= 1.03.
  `hf_callback_overhead_cpu`: the same ratio in process CPU time per sample (all threads: the
  node's network and status server included), steadier on a loaded machine and an upper bound
  where cores are spare. `load_avg` is the 1-minute load average before and after.
- `torchrun_phi_equal`: examples/swarm_optimizer.py as two peers, the joiner launched with
  `torchrun --nproc-per-node 2` (DDP on gloo, rank 0 the gateway through `SwarmOptimizer`): every
  round had two contributors (the two ranks are one peer) and the creator's φ digest equals both
  ranks' (true). With `torchrun_contributors` and `torchrun_wall_s`.
- `js_record_verified`: a js-libp2p peer (tests/js, npm packages installed in a temp folder)
  fetched a meshtrain node's peer record with kad GET_VALUE through another node and verified it
  in JavaScript, in every one of `--js-trials` runs; `js_record_latency_ms_p50` is the median of
  the reader's own timing (dial done to record verified), `js_record_wall_s_p50` the median of
  the whole Node.js process. "skipped: why" where Node.js or the npm registry is not there.
- `wheel_demo_ok`, `prometheus_scraped`: the outcome of the test that does exactly that
  (tests/test_demo.py's wheel test, tests/test_monitoring.py's Prometheus test), run here by
  pytest: true, false, or "skipped: why".
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.bench.harness import emit  # noqa: E402
from tests.example_peers import loss_fell, run_two_peers  # noqa: E402

EXAMPLE = ROOT / "examples" / "hf_trainer.py"
WARMUP = 5  # steps before timing starts: the swarm's join happens at the first


def two_peers(steps: int, H: int) -> dict[str, Any]:
    common = [
        *("--max_steps", str(steps), "--H", str(H), "--listen", "/ip4/127.0.0.1/tcp/0", "--status_port", "0"),
        *("--nat", "false", "--wait_peers", "2", "--report_to", "none", "--logging_steps", "5"),
        *("--save_strategy", "no", "--learning_rate", "3e-3", "--per_device_train_batch_size", "8"),
        *("--disable_tqdm", "true"),
    ]
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        ra, rb = run_two_peers(
            EXAMPLE,
            ["--output_dir", str(d / "a"), "--create", *common],
            ["--output_dir", str(d / "b"), *common, "--join"],
            d,
        )
    return {
        "hf_callback_phi_equal": ra["phi_digest"] == rb["phi_digest"],
        "hf_callback_loss_fell": loss_fell(ra["losses"]) and loss_fell(rb["losses"]),
        "hf_callback_rounds": [ra["rounds"], rb["rounds"]],
        "hf_callback_contributors": ra["contributors"],
        "hf_callback_losses": {
            "first": [ra["losses"][0], rb["losses"][0]],
            "last": [ra["losses"][-1], rb["losses"][-1]],
        },
        "hf_callback_wall_s": round(time.monotonic() - t0, 1),
    }


def torchrun_peer(steps: int, H: int) -> dict[str, Any]:
    """Issue 33 item 2: a torchrun script's two ranks as one peer (module docstring)."""
    example = ROOT / "examples" / "swarm_optimizer.py"
    torchrun = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
    common = ["--steps", str(steps), "--wait-peers", "2"]
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        ra, rb = run_two_peers(
            example,
            ["--data-dir", str(d / "a"), "--create", "--H", str(H), *common],
            ["--data-dir", str(d / "b"), *common, "--join"],
            d,
            join_launcher=torchrun,
        )
    return {
        "torchrun_phi_equal": rb["rank_digests"] == [ra["phi_digest"]] * 2 and set(ra["contributors"]) == {2},
        "torchrun_contributors": ra["contributors"],
        "torchrun_loss_fell": loss_fell(ra["losses"]) and loss_fell(rb["losses"]),
        "torchrun_wall_s": round(time.monotonic() - t0, 1),
    }


def trainer_rate(steps: int, *, with_callback: bool, data_dir: Path) -> tuple[float, float]:
    """Samples per second of wall time and per second of process CPU time (all threads) of the
    example's Trainer, from the end of step WARMUP to the end of step `steps`."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from meshtrain.integrations.hf import MeshtrainArguments, MeshtrainCallback

    example = _example()

    ends: list[tuple[float, float]] = []  # (wall, process CPU) at each step's end

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            ends.append((time.perf_counter(), time.process_time()))

    args = TrainingArguments(
        output_dir=str(data_dir),
        max_steps=steps,
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        report_to="none",
        save_strategy="no",
        logging_steps=10**6,
        disable_tqdm=True,
        use_cpu=True,
        data_seed=0,  # the same order in both runs
    )
    callbacks: list[Any] = [StepClock()]
    if with_callback:
        mesh = MeshtrainArguments(
            create=True, H=10 * steps, listen="/ip4/127.0.0.1/tcp/0", status_port=0, nat=False, checkpoint_every=3600
        )
        callbacks.insert(0, MeshtrainCallback(mesh))
    trainer = Trainer(model=example.tiny_llama(0), args=args, train_dataset=example.byte_text(), callbacks=callbacks)
    trainer.train()
    samples = 8 * (steps - WARMUP)
    (w0, c0), (w1, c1) = ends[WARMUP - 1], ends[-1]
    return samples / (w1 - w0), samples / (c1 - c0)


def _example() -> Any:
    """examples/hf_trainer.py as a module (its model and data; examples/ is no package)."""
    spec = importlib.util.spec_from_file_location("hf_trainer_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def overhead(steps: int, trials: int, threads: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)  # the same in both runs; 1: no OpenMP spinning against the load
    wall, cpu = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for t in range(trials):
            runs = {}
            for with_callback in (False, True) if t % 2 == 0 else (True, False):  # neither always first
                runs[with_callback] = trainer_rate(
                    steps, with_callback=with_callback, data_dir=Path(tmp) / f"{t}{with_callback}"
                )
            bare, mesh = runs[False], runs[True]
            wall.append(round(bare[0] / mesh[0], 4))
            cpu.append(round(bare[1] / mesh[1], 4))
    return {
        "hf_callback_overhead": statistics.median(wall),
        "hf_callback_overhead_cpu": statistics.median(cpu),
        "hf_callback_overhead_trials": wall,
    }


WHEEL_TEST = "tests/test_demo.py::test_the_wheel_holds_the_package_and_its_data_and_runs_outside_the_checkout"
PROMETHEUS_TEST = "tests/test_monitoring.py::test_prometheus_scrapes_two_nodes_and_every_dashboard_query_returns_series"


def pytest_outcome(node_id: str) -> bool | str:
    """Run one test with pytest: True (passed), False (failed), or "skipped: why"."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", node_id],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    lines = done.stdout.splitlines()
    if done.returncode == 0 and lines and "skipped" in lines[-1]:
        why = next((line for line in lines if line.startswith("SKIPPED")), "")
        return f"skipped: {why.split(': ', 1)[-1]}"
    return done.returncode == 0


def js_record(trials: int) -> dict[str, Any]:
    """Issue 33 item 5: a js-libp2p peer reads and verifies a meshtrain peer record (module docstring)."""
    import trio

    from meshtrain.dht import Discovery, DiscoveryConfig
    from meshtrain.dht.interop import peer_key
    from tests.js_interop import install_js, js_get
    from tests.test_dht import SWARM, swarm_of

    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        if (why := install_js(where)) is not None:
            return {"js_record_verified": f"skipped: {why}"}

        async def run() -> tuple[list[bool], list[float], list[float]]:
            async with swarm_of(3) as swarm:
                announcer = swarm.nodes[2]
                async with Discovery(announcer, SWARM, DiscoveryConfig(role="trainer", ttl=10, refresh_interval=2)):
                    key = peer_key(SWARM, announcer.peer_id)
                    with trio.fail_after(30):
                        while await swarm.nodes[0].get_interop(key) is None:
                            await trio.sleep(0.2)
                    ok, latency, wall = [], [], []
                    for _ in range(trials):
                        got, seconds = await js_get(where, swarm.nodes[0].host.addrs[0], key)
                        ok.append(bool(got["verified"]) and got["record"]["peer"] == announcer.peer_id)
                        latency.append(got.get("latency_ms", float("nan")))
                        wall.append(seconds)
                    return ok, latency, wall

        ok, latency, wall = trio.run(run)
    return {
        "js_record_verified": all(ok),
        "js_record_trials": len(ok),
        "js_record_latency_ms_p50": statistics.median(latency),
        "js_record_wall_s_p50": round(statistics.median(wall), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="few steps: checks the machinery, not the numbers")
    ap.add_argument("--steps", type=int, default=40, help="Trainer steps of the two-peer run")
    ap.add_argument("--H", type=int, default=10)
    ap.add_argument("--overhead-steps", type=int, default=60)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the overhead runs")
    ap.add_argument("--js-trials", type=int, default=5, help="runs of the js-libp2p record reader")
    a = ap.parse_args()
    if a.quick:
        a.steps, a.overhead_steps, a.trials = 20, 15, 1
    load_before = os.getloadavg()[0]
    result: dict[str, Any] = {}
    result.update(two_peers(a.steps, a.H))
    result.update(overhead(a.overhead_steps, a.trials, a.threads))
    result.update(torchrun_peer(a.steps, a.H))
    result.update(js_record(a.js_trials))
    result["wheel_demo_ok"] = pytest_outcome(WHEEL_TEST)
    result["prometheus_scraped"] = pytest_outcome(PROMETHEUS_TEST)
    result["load_avg"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    emit(result)


if __name__ == "__main__":
    main()
