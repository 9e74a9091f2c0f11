"""`meshtrain demo --quick`: the README's main job, CI-sized — four real node processes on
loopback form a swarm, train with DiLoCo, and the demo writes its plot and summary and exits 0.
The four-node run is the installed package's: a wheel built from this checkout, installed in a
fresh venv outside it (package data, entry point, no import from the checkout's tests/ or
scripts/). And the demo's flags: `--optimizer` offers the built-in optimizers the demo can run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshtrain.errors import ConfigError
from meshtrain.node.cli import build_parser
from meshtrain.node.state.checkpoint import CheckpointStore
from meshtrain.optim import BUILTIN_OPTIMIZERS

from .conftest import ROOT


def outside_the_checkout() -> dict[str, str]:
    """The environment, without a PYTHONPATH that would put a checkout ahead of the wheel."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A venv outside the checkout with meshtrain installed from a wheel built from it: the venv's
    `bin/`. Its dependencies come from this venv's site-packages, listed in a .pth file (so nothing
    is downloaded); that directory's own .pth files — the checkout's editable install — are not
    processed, so `import meshtrain` can only find the wheel's."""
    tmp = tmp_path_factory.mktemp("wheel")
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    env = outside_the_checkout()  # else pip takes the checkout for an installed meshtrain
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", tmp / "dist", ROOT], check=True, env=env)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "dependencies.pth").write_text("".join(p + "\n" for p in sys.path if p.endswith("site-packages")))
    wheel = next((tmp / "dist").glob("meshtrain-*.whl"))
    subprocess.run([*pip, "--python", venv / "bin" / "python", "install", "--no-deps", wheel], check=True, env=env)
    return venv / "bin"


def test_the_wheel_holds_the_package_and_its_data_and_runs_outside_the_checkout(installed, tmp_path):
    probe = (
        "import json, meshtrain, meshtrain.node.spec.config as c, meshtrain.node.status.server as s\n"
        "from importlib.resources import files\n"
        "print(json.dumps([meshtrain.__file__, files('meshtrain.node.status').joinpath('dashboard.html').is_file(),"
        " files('meshtrain.node.spec').joinpath('node.toml').is_file()]))"
    )
    r = subprocess.run(
        [installed / "python", "-c", probe], cwd=tmp_path, capture_output=True, text=True, env=outside_the_checkout()
    )
    assert r.returncode == 0, r.stderr[-3000:]
    where, dashboard, defaults = json.loads(r.stdout)
    assert where.startswith(str(installed.parent)) and dashboard and defaults, r.stdout + r.stderr
    version = subprocess.run(
        [installed / "meshtrain", "--version"], capture_output=True, cwd=tmp_path, env=outside_the_checkout()
    )
    assert version.returncode == 0


def run_demo(out: Path, *args: str, bin_dir: Path | None = None) -> subprocess.CompletedProcess:
    """`meshtrain demo --quick --plain --out <out> <args>`, which must exit 0: this checkout's, or
    the one installed in `bin_dir`, run from outside the checkout."""
    command = [str(bin_dir / "meshtrain")] if bin_dir else [sys.executable, "-m", "meshtrain.node.cli"]
    r = subprocess.run(
        [*command, "demo", "--quick", "--plain", "--out", str(out), *args],
        cwd=out.parent if bin_dir else ROOT,
        env=outside_the_checkout() if bin_dir else None,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    return r


def test_demo_offers_every_builtin_optimizer_but_dp_whose_round_is_one_step():
    offered = [o for o in BUILTIN_OPTIMIZERS if o != "dp"]
    assert [build_parser().parse_args(["demo", "--optimizer", o]).optimizer for o in offered] == offered
    assert build_parser().parse_args(["demo"]).optimizer == "diloco"
    with pytest.raises(ConfigError, match="--optimizer: invalid choice: 'dp'"):
        build_parser().parse_args(["demo", "--optimizer", "dp"])


@pytest.mark.slow
def test_demo_quick_trains_a_four_node_swarm(tmp_path, installed):
    out = tmp_path / "demo"
    r = run_demo(out, "--steps", "40", bin_dir=installed)  # two rounds at the quick run's H = 20
    summary = json.loads((out / "summary.json").read_text())
    assert summary["nodes"] == 4 and summary["nodes_finished"] == 4 and not summary["interrupted"]
    assert all(n >= 1 for n in summary["rounds"]), summary  # every node took part in outer rounds
    finals = summary["eval_loss_final"]
    assert all(f is not None and f < summary["eval_loss_first"] for f in finals), summary  # it learned
    assert (out / "loss.png").stat().st_size > 1000
    # progress was shown while it ran (one JSON line per node every few seconds in --plain mode)
    progress = [json.loads(x) for x in r.stdout.splitlines() if x.startswith('{"node"')]
    assert {p["node"] for p in progress} == {0, 1, 2, 3}


@pytest.mark.slow
def test_demo_pipeline_quick_trains_six_nodes_on_three_stages(tmp_path):
    """`meshtrain demo --pipeline --quick`: six daemons place themselves on three stages from the
    membership, agree on the placement, train SkipPipe iterations to the spec's last step with
    DiLoCo among each stage's replicas (H = 10), and checkpoint their own stage — the replicas of
    a stage bit-identical after the last round."""
    out = tmp_path / "demo"
    r = run_demo(out, "--pipeline", "--steps", "20", "--replica-sync", "diloco")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["nodes"] == 6 and summary["nodes_finished"] == 6 and not summary["interrupted"]
    pipe = summary["pipeline"]
    assert [len(s) for s in pipe["stage_map"]] == [2, 2, 2], pipe  # every stage has replicas
    assert all(f is not None and f < pipe["loss_first"] for f in pipe["loss_final"]), pipe  # it learned
    assert (out / "loss.png").stat().st_size > 1000
    progress = [json.loads(x) for x in r.stdout.splitlines() if x.startswith('{"node"')]
    assert {p["stage"] for p in progress if p["stage"] is not None} == {0, 1, 2}
    assert summary["rounds"] == [2] * 6, summary  # two DiLoCo rounds per stage
    # each node checkpointed its own stage; a stage's replicas hold the same bits after the round
    weights: dict[int, set[bytes]] = {}
    for i in range(6):
        ckpt = CheckpointStore(out / "nodes" / f"node{i}" / "checkpoints", readonly=True).load_latest()
        assert ckpt is not None and ckpt.step == 20, i
        state = ckpt.state
        blob = b"".join(state["weights"][k].numpy().tobytes() for k in sorted(state["weights"]))
        weights.setdefault(state["pipeline"]["stage"], set()).add(blob)
    assert sorted(weights) == [0, 1, 2] and all(len(v) == 1 for v in weights.values())
