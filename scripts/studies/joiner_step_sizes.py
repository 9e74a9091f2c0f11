"""How much larger a fresh joiner's pseudo-gradient is than a veteran's: why a joiner's weight-0
period lasts at least `JOIN_WARMUP_STEPS` (optim/outer.py).

    python scripts/studies/joiner_step_sizes.py [--veteran-steps 272] [--H 2] [--rounds 16]

A veteran trains gpt-tiny alone with the spec's default inner AdamW (lr 2e-3, weight decay 0.01,
gradients clipped to 1, batch 16 of the built-in corpus, context 64) for `--veteran-steps`; then,
round after round from the same θ, the veteran (its AdamW kept) and a joiner (a fresh AdamW, as
`OuterOptimizer.join` leaves it) each train `--H` steps on their own batches, and the norm of each
one's Δ is taken per fifth of the flat parameter vector (a robust round's owner screens its part
against the median norm: a ratio outside [1/4, 4] is flagged, collective/contract.py
`screening_rule`). After each round the joiner's θ is reset to the veteran's, so only the
optimizers differ. Last line: one JSON object, the veteran's Δ norm over the joiner's per round
and fifth, with the joiner's inner steps at the round's end.

With `--outer-lr` (e.g. 0.7, the spec's default, and `--outer-momentum 0.9`) the veteran trains
as a swarm's creator does before anyone joins: DiLoCo rounds alone every H steps (Nesterov SGD on
its own Δ, θ reset to φ), and each compared round applies the two peers' mean Δ the same way.
Measured at --veteran-steps 318 --H 2 (a grouped daemon swarm's creator when its joiners' warm-up
ended, tests/test_grouped_daemons.py): per fifth, 0.13–0.43 of the joiner's Δ at 20 joiner
steps, 0.38–0.63 at 40, 0.36–0.79 at 120, 0.23–0.81 at 240 — under the screen's 1/4 in most
fifths at the end of `JOIN_WARMUP_STEPS`, and far from 1 for hundreds of steps; without outer
steps, 0.62–0.82 at 20 and 0.82–1.22 from 40 on. The outer steps' jumps inflate the veteran's
AdamW second moments. What a joiner does about it (`--joiner-state`, same run, 60 rounds): seeded
with the veteran's mean second moment per tensor and its step count, as a node now seeds it
(optim/inner_moments.py), 0.77–1.04 at 20, 0.86–2.0 at 40, 0.82–1.13 at 80, 0.97–1.29 at 120;
with a copy of the veteran's whole AdamW state, 0.90–0.99, 0.90–1.02, 1.03–1.04, 1.03–1.11. (A lone DiLoCo at outer lr 0.7 is chaotic: a hand-written Nesterov step,
equal up to rounding, gave 0.08–0.23 at 20 and 0.12–0.44 at 40.)
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from meshtrain.models import Corpus  # noqa: E402
from meshtrain.models.sources import build_model  # noqa: E402

LR, WEIGHT_DECAY, CLIP, BATCH, CONTEXT, SEED = 2e-3, 0.01, 1.0, 16, 64, 7
PARTS = 5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--veteran-steps", type=int, default=272)
    ap.add_argument("--H", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--outer-lr", type=float, default=0.0, help="DiLoCo's outer lr (0: no outer steps)")
    ap.add_argument("--outer-momentum", type=float, default=0.0, help="its Nesterov momentum")
    ap.add_argument(
        "--joiner-state",
        choices=("fresh", "copied", "moments"),
        default="fresh",
        help="the joiner's AdamW: fresh (as join leaves it today), copied (the veteran's whole state, "
        "8 B/param more to download), moments (only each tensor's mean second moment and the step "
        "count: two numbers a tensor; first moments start at 0)",
    )
    a = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    corpus = Corpus.default("chars")
    veteran = build_model("gpt-tiny", vocab_size=corpus.vocab_size, seed=SEED, context=CONTEXT)

    def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)

    def train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, peer: str) -> None:
        x, y = corpus.batch(BATCH, CONTEXT, seed=SEED, peer=peer, step=step)
        out = model(x)
        logits = out if isinstance(out, torch.Tensor) else out.logits
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()

    def flat(model: torch.nn.Module) -> torch.Tensor:
        return torch.nn.utils.parameters_to_vector(model.parameters()).detach()

    def load_flat(model: torch.nn.Module, vector: torch.Tensor) -> None:
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(vector.clone(), model.parameters())  # its own memory

    phi_param = torch.nn.Parameter(flat(veteran).clone())
    outer = (
        torch.optim.SGD([phi_param], lr=a.outer_lr, momentum=a.outer_momentum, nesterov=a.outer_momentum > 0)
        if a.outer_lr
        else None
    )

    def outer_step(phi: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """φ after DiLoCo's outer step on `delta`: SGD (Nesterov) with grad = Δ, as optim/diloco.py."""
        assert outer is not None
        with torch.no_grad():
            phi_param.copy_(phi)
        phi_param.grad = delta
        outer.step()
        return phi_param.detach().clone()

    def delta_of(model: torch.nn.Module, opt: torch.optim.Optimizer, phi: torch.Tensor, start: int, peer: str):
        load_flat(model, phi)
        for s in range(start, start + a.H):
            train(model, opt, s, peer)
        return phi - flat(model)

    vet_opt = adamw(veteran)
    phi = flat(veteran)
    for s in range(a.veteran_steps):
        train(veteran, vet_opt, s, "veteran")
        if a.outer_lr and (s + 1) % a.H == 0:  # a round alone
            phi = outer_step(phi, phi - flat(veteran))
            load_flat(veteran, phi)
    phi = flat(veteran)
    joiner = copy.deepcopy(veteran)
    joiner_opt = adamw(joiner)
    if a.joiner_state == "copied":
        joiner_opt.load_state_dict(copy.deepcopy(vet_opt.state_dict()))
    elif a.joiner_state == "moments":
        for jp, vp in zip(joiner.parameters(), veteran.parameters(), strict=True):
            v = vet_opt.state[vp]
            joiner_opt.state[jp] = {
                "step": v["step"].clone(),
                "exp_avg": torch.zeros_like(jp),
                "exp_avg_sq": torch.full_like(jp, float(v["exp_avg_sq"].mean())),
            }
    rows = []
    for r in range(a.rounds):
        start = a.veteran_steps + r * a.H
        joined = delta_of(joiner, joiner_opt, phi, start, "joiner")
        held = delta_of(veteran, vet_opt, phi, start, "veteran")
        phi = outer_step(phi, (held + joined) / 2) if a.outer_lr else flat(veteran)
        ratios = [
            round(float(x.norm() / y.norm()), 3) for x, y in zip(held.chunk(PARTS), joined.chunk(PARTS), strict=True)
        ]
        rows.append({"joiner_steps": (r + 1) * a.H, "veteran_over_joiner": ratios})
        print(f"joiner steps {(r + 1) * a.H:>3}: veteran's Δ norm over the joiner's, per fifth {ratios}", flush=True)
    print(json.dumps({"veteran_steps": a.veteran_steps, "H": a.H, "parts": PARTS, "rounds": rows}))


if __name__ == "__main__":
    main()
