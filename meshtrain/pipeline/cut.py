"""How a pipeline swarm's model is cut into stages, as the swarm spec writes it (`stage_cut`).

Stage 0 is always the embedding and the head (SkipPipe: the origins hold the data and compute the
loss); stages 1..S-1 are contiguous runs of transformer blocks (a GPT's blocks, or a transformers
model's decoder layers: models/staged.py), written in the spec as
`0-1,2-3` (stage 1 runs blocks 0 and 1, stage 2 blocks 2 and 3; a single block is `4`). The
default is the balanced cut (`GPT.stages`' `block_ranges`: earlier stages take the extra block),
which `swarm create` pins into the signed spec (from the preset's block count, or an hf model's
`num_hidden_layers`) so every peer cuts the same way whatever version of meshtrain it runs; a spec may also name an unbalanced cut (a slow first block stage, say).

Pure text and ranges, no I/O. A malformed cut is a `ConfigError` naming what is wrong.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshtrain.errors import ConfigError
from meshtrain.models.gpt import block_ranges


def balanced_cut(n_layer: int, stages: int) -> tuple[range, ...]:
    """The default: n_layer blocks over S − 1 block stages, sizes differing by at most one."""
    if not 2 <= stages <= n_layer + 1:
        raise ConfigError(f"a {n_layer}-block model splits into 2..{n_layer + 1} stages, not {stages}")
    return block_ranges(n_layer, stages - 1)


def format_stage_cut(ranges: Sequence[range]) -> str:
    """`(range(0, 2), range(2, 4))` -> "0-1,2-3"."""
    return ",".join(f"{r.start}" if len(r) == 1 else f"{r.start}-{r.stop - 1}" for r in ranges)


def parse_stage_cut(text: str, stages: int, n_layer: int | None = None) -> tuple[range, ...]:
    """The block ranges of stages 1..S-1 from "0-1,2-3"; with `n_layer`, they must cover blocks
    0..n_layer-1 exactly, in order."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != stages - 1:
        raise ConfigError(f"stage_cut {text!r} names {len(parts)} block stages; {stages} stages have {stages - 1}")
    out: list[range] = []
    for p in parts:
        lo, _, hi = p.partition("-")
        try:
            a, b = int(lo), int(hi or lo)
        except ValueError:
            raise ConfigError(f"stage_cut {text!r}: {p!r} is not a block range like 2-3") from None
        if a < 0 or b < a:
            raise ConfigError(f"stage_cut {text!r}: {p!r} is not a block range like 2-3")
        out.append(range(a, b + 1))
    expect = 0
    for r in out:
        if r.start != expect:
            raise ConfigError(f"stage_cut {text!r}: stages must run contiguous blocks in order from block 0")
        expect = r.stop
    if n_layer is not None and expect != n_layer:
        raise ConfigError(f"stage_cut {text!r} covers blocks 0..{expect - 1}; the model has {n_layer}")
    return tuple(out)
