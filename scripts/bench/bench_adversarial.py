"""Adversaries in an open swarm: what robust aggregation and strikes let through, and how fast.

    python scripts/bench/bench_adversarial.py [--honest 4] [--adversaries 1] [--H 10] [--rounds 8]
        [--modes signflip10,noise,zeros,replay,replay-phi,otherdata] [--batch-size 8] [--score-samples -1]
        [--spot-check-steps 0] [--spot-check-samples -1] [--rules robust,mean] [--seeds 1] [--honest-repeats 1]

Real daemons (`meshtrain node start`, one process each) on loopback train gpt-tiny (DiLoCo) in an
open swarm: `--honest` honest peers and `--adversaries` adversaries, each an ordinary daemon with
`MESHTRAIN_ADVERSARY=<mode>` (the test hook of meshtrain/node/trust/adversary.py: sign-flipped x10,
Gaussian noise of the update's norm, zeros, a replay of its first update, the same replay publishing
φ digests other than its own, training on other data).
Every mode runs twice: with the open swarm's default (trimmed_mean, screening, strikes) and with
`aggregation = "mean"` (no defence), against a swarm of the honest peers alone under the same rule.
The honest peers keep their identities across runs (the same data), so the runs differ by the
adversaries only. The issue asks for 8 daemons and two adversaries; this machine has 2 cores, so
the default is 5 daemons and one adversary (pass --honest 6 --adversaries 2 where cores allow).

Measured (last line, one JSON object):
- `loss_gap_vs_honest`: per mode, {robust, mean}: the honest peers' final held-out loss over the
  honest-only swarm's, minus 1 (null: the swarm diverged); `worst_loss_gap` its largest (robust).
  With `--seeds K` every run is repeated with swarm seeds 0..K-1 (the same command's honest-only
  swarm ends up to 5 % apart from one invocation to the next, more than the 0.02 target: every
  invocation mints new identities, and a peer's data is a function of its id), each gap is the
  mean over seeds of (run with adversaries ÷ honest-only run of the same seed), and
  `loss_gap_by_seed` lists them; with `--honest-repeats R` the honest-only swarm runs R times per
  seed, the reference is their mean loss, and `honest_run_spread` (per seed, the largest of those
  runs over the smallest, minus 1) shows the noise floor within one invocation (it was 0: the
  same identities and seed give the same swarm);
- `rounds_to_exclude`: per mode, the outer round in which the honest peers excluded the
  adversaries, the latest over seeds (null: not excluded within a run); `max_rounds_to_exclude` over the
  harmful modes, which screening catches (signflip10, noise, zeros by norm and direction; replay by
  its echo of an earlier round, collective/echoes.py), not over otherdata (it does the work, on
  other data, and is left to loss scoring: `HARMFUL` says why);
- `honest_excluded`: honest peers any honest peer excluded, over all runs (target 0);
- `exclusion_lag_rounds`: per mode, the most rounds an honest peer completed with the adversary
  still in them after it had excluded the adversary (its log line's time against its history's
  rounds and contributor counts; target ≤ 1: a round already forming may still hold it);
  `max_exclusion_lag_rounds` over the modes;
- `verify_overhead`: screening's time per round (owner side: norms and cosines of every
  contribution to one part of the demo model, gpt-small) plus loss scoring's (`score_samples`
  peers, 3 forward passes of `score_batches` gpt-tiny batches each, `scoring_ms_per_round`; `--score-samples`,
  default every peer, so that a 6-round run can reach 3 strikes) over a round's wall time at H = 50
  (50 x the median wall time per step of the honest peers in the runs, rounds included, gpt-tiny:
  pessimistic, as gpt-small's steps are slower);
- `sybil_cost_ratio`: minting 100 admitted identities against one (scripts/bench/bench_admission.py).

With `--spot-check-steps k` the swarms also run replay spot-checks (node/trust/spot_check.py:
`--spot-check-samples` peers per round, default every peer; pass `--score-samples 0` to see what
spot-checks catch alone), and the line adds `spot_check_ms_per_round` (one owner's checks of one
round: k AdamW steps of gpt-tiny per sampled peer, one thread), `spot_check_share_at_h50` (that
over `round_s_at_h50`, k as given) and the part-checks flagged by spot-check against the
adversaries and against honest peers (`spot_flags`, from the honest daemons' logs).
`--rules robust` skips the runs without a defence.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from meshtrain.collective.aggregation import screen_contributions  # noqa: E402
from meshtrain.collective.echoes import ECHO_ROUNDS, EchoMemory, PartSketch  # noqa: E402
from meshtrain.collective.protocol import AllReduceConfig  # noqa: E402
from meshtrain.models.sources import build_model  # noqa: E402
from meshtrain.node.spec.signed import SignedSpec  # noqa: E402
from meshtrain.node.spec.swarm import SwarmSpec  # noqa: E402
from meshtrain.node.trust import adversary  # noqa: E402
from meshtrain.transport.identity import Identity  # noqa: E402
from scripts.bench.harness import Daemon, emit  # noqa: E402

# The harmful modes, which `max_rounds_to_exclude` holds to the target, all caught by screening
# (norms and directions; replay by its echo, collective/echoes.py): those that do no work (noise,
# zeros, replay: free riders) or wreck the model (signflip10). Other data does the work, on other
# windows, is left to loss scoring (node/trust/scoring.py, which at this scale does not separate it), and
# did no measurable harm here: with no defence at all (plain mean) its gap was 0.17 %, against
# 1.5 % for a replay and 143 % for signflip10 (docs/bench/bench_adversarial_issue21.json).
HARMFUL = ("signflip10", "noise", "zeros", "replay")
RUN_TIMEOUT = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_swarm(root: Path, keys: Path, spec: SwarmSpec, modes: list[str | None], *, threads: int = 1) -> dict:
    """One swarm: a daemon per entry of `modes` (None: honest), peer i's identity from keys/n{i}.
    The honest peers' final eval loss, who excluded whom, and the mean inner step time."""
    dirs = [root / f"n{i}" for i in range(len(modes))]
    for i, d in enumerate(dirs):
        d.mkdir(parents=True)
        shutil.copy(keys / f"n{i}" / "identity.key", d / "identity.key")
        os.chmod(d / "identity.key", 0o600)
    signed = SignedSpec.create(spec, Identity.load_or_create(dirs[0]))
    signed.save(root / "swarm.json")
    ids = [Identity.load_or_create(d).peer_id_str for d in dirs]
    ports = [free_port() for _ in dirs]
    entry = f"/ip4/127.0.0.1/tcp/{ports[0]}/p2p/{ids[0]}"
    nodes: list[Daemon] = []
    for i, (d, mode) in enumerate(zip(dirs, modes, strict=True)):
        args = ["--quiet", "--no-nat", "--swarm", str(root / "swarm.json"), "--status-port", "0"]
        args += ["--listen", f"/ip4/127.0.0.1/tcp/{ports[i]}", "--threads", str(threads)]
        args += ["--wait-peers", str(len(modes)), "--checkpoint-every", "3600"]
        if i:
            args += ["--bootstrap", entry]
        env = {adversary.ENV: mode} if mode is not None else {}
        nodes.append(Daemon(d, d / "stderr.log", *args, env=env, loopback=False))
        if i == 0:  # the others bootstrap from it: wait until it listens (its daemon file)
            nodes[0].daemon(timeout=90)
    procs = [n.p for n in nodes]
    honest = [p for p, m in zip(procs, modes, strict=True) if m is None]
    deadline = time.monotonic() + RUN_TIMEOUT
    try:
        for p in honest:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
    losses, steps, excluded, spot_flags = [], [], {}, {}
    lags: list[int | None] = []
    for d, mode, p in zip(dirs, modes, procs, strict=True):
        if mode is not None:
            continue
        if p.returncode != 0:
            raise SystemExit(f"honest daemon {d} exited {p.returncode}: {(d / 'stderr.log').read_text()[-2000:]}")
        history = json.loads((d / "history.json").read_text())
        evals = [h["eval_loss"] for h in history if h.get("eval_loss") is not None]
        losses.append(evals[-1] if evals else math.nan)
        timed = [(h["step"], h["t"]) for h in history if "t" in h and "step" in h]
        if len(timed) >= 2 and timed[-1][0] > timed[0][0]:  # wall time per step, rounds included
            steps.append((timed[-1][1] - timed[0][1]) / (timed[-1][0] - timed[0][0]))
        for line in (d / "stderr.log").read_text().splitlines():
            if "flagged a contribution by spot-check" in line:
                short = dict(kv.split("=", 1) for kv in line.split() if "=" in kv).get("peer", "")
                who = next((p for p in ids if short and p.endswith(short)), short)
                spot_flags[who] = spot_flags.get(who, 0) + 1
            if "peer excluded by strikes" in line:
                fields = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
                excluded.setdefault(fields["peer"], int(fields["at_round"]))
                lags.append(exclusion_lag(line, history, len(modes)))
    loss = losses[0] if losses else math.nan
    lag = max((x for x in lags if x is not None), default=None)
    return {"ids": ids, "loss": loss, "excluded": excluded, "step_s": steps, "spot_flags": spot_flags, "lag": lag}


def exclusion_lag(line: str, history: list[dict], members: int) -> int | None:
    """Rounds this honest peer completed with every member in them (the excluded one included)
    after the moment its log says it excluded a peer, before its first round with fewer: 0 when
    the next round formed without it, 1 when a round already forming then still had it. A count of
    contributors, not their ids: a round an honest peer also missed reads as one without the
    excluded peer. None: the log line has no time, or no round followed."""
    try:
        at = time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")) + int(line[20:23]) / 1000
    except ValueError:
        return None
    rounds: dict[int, int] = {}
    for h in history:
        if h.get("t", 0) > at and h.get("contributors") is not None:
            rounds.setdefault(h["round"], h["contributors"])
    for lag, r in enumerate(sorted(rounds)):
        if rounds[r] < members:
            return lag
    return None


def screening_seconds(peers: int, trials: int = 20) -> float:
    """One owner's screening of its part of the demo model (gpt-small) among `peers` peers: the
    norms and cosines of every contribution (`screen_contributions`), and replay screening's
    sketch of them compared with its last `ECHO_ROUNDS` rounds' (collective/echoes.py): what
    verification adds to a robust round on the owner's side (filing a strike is one CRDT write,
    and only when flagged)."""
    total = sum(p.numel() for p in build_model("gpt-small", vocab_size=256, seed=0).parameters())
    numel = total // peers
    stack = torch.randn(peers, numel)
    aggregate = stack.median(dim=0).values
    config = AllReduceConfig(robust="trimmed_mean", screen_norm=4.0, screen_alignment=0.25)
    names = [f"p{i}" for i in range(peers)]
    memory = EchoMemory(SwarmSpec().aggregation.screen_echo)
    rows = dict(zip(names, stack, strict=True))
    for r in range(ECHO_ROUNDS):  # a full memory
        memory.remember("", PartSketch.of(r, (0, numel), total, rows).with_aggregate(aggregate))
    t0 = time.perf_counter()
    for t in range(trials):
        screen_contributions(names, stack, aggregate, config, 0)
        sketch = PartSketch.of(ECHO_ROUNDS + t, (0, numel), total, rows)
        memory.match("", sketch)
        memory.remember("", sketch.with_aggregate(aggregate))
    return (time.perf_counter() - t0) / trials


def scoring_seconds(peers: int, samples: int, batch_size: int, score_batches: int, trials: int = 5) -> float:
    """One owner's loss scoring of one round (node/trust/scoring.py `score_round`: 3 forward passes of
    `score_batches` batches per sampled peer, gpt-tiny, the model the rounds here train), in the worker thread
    beside training: the CPU time it takes from the round."""
    from meshtrain.collective.flat import flatten_fp32, part_bounds
    from meshtrain.models import Corpus
    from meshtrain.node.trust.scoring import score_round

    if not samples:
        return 0.0
    corpus = Corpus.default("chars")
    model = build_model("gpt-tiny", vocab_size=corpus.vocab_size, seed=0)
    phi = {n: p.detach().clone() for n, p in model.named_parameters()}
    names = list(phi)
    numel = flatten_fp32(phi).numel()
    part = tuple(part_bounds(numel, peers)[:2])
    g = torch.Generator().manual_seed(0)
    contribs = {f"p{i}": 1e-3 * torch.randn(part[1] - part[0], generator=g) for i in range(samples)}
    batches = {
        p: [corpus.batch(batch_size, 32, seed=0, peer=p, step=9 - s) for s in range(score_batches)] for p in contribs
    }
    aggregate = torch.stack(list(contribs.values())).mean(dim=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the daemons run here (--threads 1)
    try:
        score_round(model, phi, names, part, contribs, aggregate, batches)  # warm-up
        t0 = time.perf_counter()
        for _ in range(trials):
            score_round(model, phi, names, part, contribs, aggregate, batches)
        return (time.perf_counter() - t0) / trials
    finally:
        torch.set_num_threads(threads)


def spot_check_seconds(peers: int, samples: int, steps: int, batch_size: int, trials: int = 3) -> float:
    """One owner's replay spot-checks of one round (node/trust/spot_check.py: `steps` AdamW steps of one
    gpt-tiny batch per sampled peer from φ, then two cosines on its part), in the worker thread
    beside training: the CPU time it takes from the round."""
    from meshtrain.collective.flat import part_bounds
    from meshtrain.models import Corpus
    from meshtrain.node.trust.spot_check import recompute_update, spot_check_round

    if not samples or not steps:
        return 0.0
    corpus = Corpus.default("chars")
    model = build_model("gpt-tiny", vocab_size=corpus.vocab_size, seed=0)
    phi = {n: p.detach().clone() for n, p in model.named_parameters()}
    names = list(phi)
    numel = sum(t.numel() for t in phi.values())
    part = tuple(part_bounds(numel, peers)[:2])
    g = torch.Generator().manual_seed(0)
    # The owner checks the sampled peers but itself.
    contribs = {f"p{i}": 1e-3 * torch.randn(part[1] - part[0], generator=g) for i in range(min(samples, peers - 1))}
    aggregate = torch.stack(list(contribs.values())).mean(dim=0)

    def one_round() -> None:
        recomputed = {
            p: recompute_update(
                model,
                phi,
                names,
                [corpus.batch(batch_size, 32, seed=0, peer=p, step=s) for s in range(steps)],
                lr=2e-3,
                weight_decay=0.01,
                clip=1.0,
            )
            for p in contribs
        }
        spot_check_round(recomputed, part, contribs, aggregate)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the daemons run here (--threads 1)
    try:
        one_round()  # warm-up
        t0 = time.perf_counter()
        for _ in range(trials):
            one_round()
        return (time.perf_counter() - t0) / trials
    finally:
        torch.set_num_threads(threads)


def sybil_cost_ratio() -> float | None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench" / "bench_admission.py"), "--trials", "5"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])["sybil_cost_ratio"]
    except (IndexError, ValueError, KeyError):
        return None


def gap(loss: float, reference: float) -> float | None:
    return round(loss / reference - 1, 4) if math.isfinite(loss) and math.isfinite(reference) else None


def mean_gap(gaps: list[float | None]) -> float | None:
    """The mean of one mode's gaps over seeds (None if any run diverged)."""
    return round(sum(gaps) / len(gaps), 4) if gaps and all(g is not None for g in gaps) else None  # type: ignore[arg-type]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--honest", type=int, default=4)
    ap.add_argument("--adversaries", type=int, default=1)
    ap.add_argument("--H", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--modes", default=",".join(adversary.MODES))
    ap.add_argument(
        "--score-samples",
        type=int,
        default=-1,
        help="peers scored by loss per round (spec score_samples); -1 = every peer of the swarm",
    )
    ap.add_argument(
        "--spot-check-steps",
        type=int,
        default=0,
        help="replay spot-checks: inner steps recomputed per sampled peer (spec spot_check_steps); 0 = off",
    )
    ap.add_argument(
        "--spot-check-samples",
        type=int,
        default=-1,
        help="peers spot-checked per round (spec spot_check_samples); -1 = every peer of the swarm",
    )
    ap.add_argument("--rules", default="robust,mean", help="robust,mean or robust (skip the runs without a defence)")
    ap.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="swarm seeds 0..K-1, every run repeated with each; gaps are the mean over seeds (one seed's gaps swing by a few %%)",
    )
    ap.add_argument(
        "--honest-repeats",
        type=int,
        default=1,
        help="honest-only swarms per seed and rule; the reference loss is their mean, `honest_run_spread` their spread",
    )
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    n = args.honest + args.adversaries
    t_start = time.monotonic()
    base = dict(model="gpt-tiny", H=args.H, steps=args.H * args.rounds, batch_size=args.batch_size, pow_bits=8)
    base["eval_every"] = base["steps"]  # one held-out evaluation, of the final φ
    samples = n if args.score_samples < 0 else args.score_samples
    base["score_samples"] = samples
    spot_samples = n if args.spot_check_samples < 0 else args.spot_check_samples
    base.update(spot_check_steps=args.spot_check_steps, spot_check_samples=spot_samples)
    specs = {"robust": SwarmSpec(**base), "mean": SwarmSpec(**base, aggregation="mean")}
    specs = {rule: spec for rule, spec in specs.items() if rule in args.rules.split(",")}
    assert specs["robust"].aggregation.rule == "trimmed_mean"  # the open swarm's default
    seeds = list(range(args.seeds))
    runs: dict[str, dict] = {}  # "<seed>/<mode or honest>/<rule>"
    with tempfile.TemporaryDirectory(prefix="bench_adversarial_") as tmp:
        root = Path(tmp)
        keys = root / "keys"
        for i in range(n):  # identities kept across runs: the honest peers' data is the same
            Identity.load_or_create(keys / f"n{i}")
        honest_modes: list[str | None] = [None] * args.honest
        repeats = [f"honest{k}" for k in range(1, max(args.honest_repeats, 1))]  # beyond the first, "honest"
        for seed in seeds:
            for label in ["honest", *repeats, *modes]:
                for rule, spec in specs.items():
                    spec = spec.model_copy(update={"seed": seed})
                    roles = honest_modes if label.startswith("honest") else honest_modes + [label] * args.adversaries
                    r = run_swarm(root / f"{seed}-{label}-{rule}", keys, spec, roles)
                    runs[f"{seed}/{label}/{rule}"] = r
                    print(f"seed {seed} {label}/{rule}: loss {r['loss']:.4f} excluded {r['excluded']}", file=sys.stderr)
        for seed in seeds:  # the reference: the mean of the seed's honest-only runs
            for rule in specs:
                losses = [runs[f"{seed}/{label}/{rule}"]["loss"] for label in ["honest", *repeats]]
                runs[f"{seed}/honest/{rule}"]["runs_loss"] = losses
                runs[f"{seed}/honest/{rule}"]["loss"] = sum(losses) / len(losses)
    ids = runs["0/honest/robust"]["ids"]
    honest_ids, liar_ids = set(ids[: args.honest]), set(runs[f"0/{modes[0]}/robust"]["ids"][args.honest :])
    gaps_by_seed = {
        mode: {
            rule: [gap(runs[f"{s}/{mode}/{rule}"]["loss"], runs[f"{s}/honest/{rule}"]["loss"]) for s in seeds]
            for rule in specs
        }
        for mode in modes
    }
    loss_gap = {mode: {rule: mean_gap(g) for rule, g in by_rule.items()} for mode, by_rule in gaps_by_seed.items()}
    rounds_to_exclude, honest_excluded, exclusion_lag_rounds = {}, set(), {}
    for mode in modes:
        caught = [runs[f"{s}/{mode}/robust"]["excluded"].get(p) for s in seeds for p in liar_ids]
        rounds_to_exclude[mode] = max(c // args.H for c in caught) if all(c is not None for c in caught) else None
        lags = [runs[f"{s}/{mode}/robust"]["lag"] for s in seeds]
        exclusion_lag_rounds[mode] = max((x for x in lags if x is not None), default=None)
    spot_flags = {"adversaries": 0, "honest": 0}
    for r in runs.values():
        honest_excluded |= set(r["excluded"]) & honest_ids
        for p, count in r["spot_flags"].items():
            spot_flags["honest" if p in honest_ids else "adversaries"] += count
    step_s = [s for r in runs.values() for s in r["step_s"] if s > 0]
    round_at_h50 = 50 * (sorted(step_s)[len(step_s) // 2] if step_s else math.nan)
    robust_gaps = [g["robust"] for g in loss_gap.values()]
    scoring = scoring_seconds(n, samples, args.batch_size, specs["robust"].verification.score_batches)
    spot = spot_check_seconds(n, spot_samples, args.spot_check_steps, args.batch_size)
    harmful = [rounds_to_exclude[m] for m in modes if m in HARMFUL]
    emit(
        {
            "daemons": n,
            "adversaries": args.adversaries,
            "model": "gpt-tiny",
            "H": args.H,
            "rounds": args.rounds,
            "strikes_to_exclude": specs["robust"].verification.strikes,
            "seeds": args.seeds,
            "final_eval_loss_honest": {
                rule: [round(runs[f"{s}/honest/{rule}"]["loss"], 4) for s in seeds] for rule in specs
            },
            # The noise floor: per seed, the largest honest-only run's loss over the smallest's, minus 1.
            "honest_run_spread": {
                rule: [
                    round(max(r) / min(r) - 1, 4)
                    for r in (runs[f"{s}/honest/{rule}"]["runs_loss"] for s in seeds)
                    if all(math.isfinite(x) for x in r)
                ]
                for rule in specs
            }
            if args.honest_repeats > 1
            else None,
            "honest_repeats": max(args.honest_repeats, 1),
            "loss_gap_vs_honest": loss_gap,
            "loss_gap_by_seed": gaps_by_seed if args.seeds > 1 else None,
            "worst_loss_gap": max((g for g in robust_gaps if g is not None), default=None)
            if all(g is not None for g in robust_gaps)
            else None,
            "rounds_to_exclude": rounds_to_exclude,
            "max_rounds_to_exclude": max(harmful) if harmful and all(r is not None for r in harmful) else None,
            "honest_excluded": len(honest_excluded),
            "exclusion_lag_rounds": exclusion_lag_rounds,
            "max_exclusion_lag_rounds": max((x for x in exclusion_lag_rounds.values() if x is not None), default=None),
            "score_samples": samples,
            "score_batches": specs["robust"].verification.score_batches,
            "verify_overhead": float(f"{(screening_seconds(n) + scoring) / round_at_h50:.3g}"),
            "screening_ms_per_round": round(screening_seconds(n) * 1000, 2),
            "scoring_ms_per_round": round(scoring * 1000, 2),
            "round_s_at_h50": round(round_at_h50, 2),
            "spot_check_steps": args.spot_check_steps,
            "spot_check_samples": spot_samples if args.spot_check_steps else 0,
            "spot_check_ms_per_round": round(spot * 1000, 2),
            "spot_check_share_at_h50": float(f"{spot / round_at_h50:.3g}"),
            "spot_flags": spot_flags,
            "sybil_cost_ratio": sybil_cost_ratio(),
            "wall_s": round(time.monotonic() - t_start, 1),
        }
    )


if __name__ == "__main__":
    main()
