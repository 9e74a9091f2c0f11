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

    def delta_by_part(model: torch.nn.Module, opt: torch.optim.Optimizer, start: int, peer: str) -> torch.Tensor:
        phi = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        for s in range(start, start + a.H):
            train(model, opt, s, peer)
        delta = phi - torch.cat([p.detach().flatten() for p in model.parameters()])
        return torch.stack([c.norm() for c in delta.chunk(PARTS)])

    vet_opt = adamw(veteran)
    for s in range(a.veteran_steps):
        train(veteran, vet_opt, s, "veteran")
    joiner = copy.deepcopy(veteran)
    joiner_opt = adamw(joiner)
    rows = []
    for r in range(a.rounds):
        start = a.veteran_steps + r * a.H
        joined = delta_by_part(joiner, joiner_opt, start, "joiner")
        held = delta_by_part(veteran, vet_opt, start, "veteran")
        joiner.load_state_dict(veteran.state_dict())
        ratios = [round(float(x), 3) for x in held / joined]
        rows.append({"joiner_steps": (r + 1) * a.H, "veteran_over_joiner": ratios})
        print(f"joiner steps {(r + 1) * a.H:>3}: veteran's Δ norm over the joiner's, per fifth {ratios}", flush=True)
    print(json.dumps({"veteran_steps": a.veteran_steps, "H": a.H, "parts": PARTS, "rounds": rows}))


if __name__ == "__main__":
    main()
