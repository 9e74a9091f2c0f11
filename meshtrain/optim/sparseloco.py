"""SparseLoCo (Sarfi, Thérien, Lidin, Belilovsky 2025, Templar, arXiv 2508.15706): DiLoCo whose
peers send a top-k of their pseudo-gradient, quantised to 2 bits, with error feedback in place of
the outer momentum. The method behind Covenant-72B (arXiv 2603.08163).

The rule (paper Alg. 1; docs/algorithms.md, SparseLoCo), for peer r every H inner steps:

    Δ_r ← φ − θ_r                              pseudo-gradient (DiLoCo's sign)
    e_r ← β·e_r + Δ_r                          decayed error feedback: plays the outer momentum
    ŝ_r ← Q(TopK_chunk(e_r))                   per chunk of C values keep the k largest |·|, 2-bit
    e_r ← e_r − decode(ŝ_r)                    keep what was not sent
    Δ̄  ← (1/R)·Σ_r decode(ŝ_r)                 sparse aggregation over the union of indices
    φ  ← φ − α·Δ̄ ;  θ_r ← φ                    plain outer SGD, no momentum

Error feedback is the base class's (`OuterOptimizer.feed_back`, `error_feedback = β`): e is this
peer's own state — checkpointed, never averaged, never sent to a joiner. The wire format is
`sparse_codec.ChunkedTopK`; aggregation is `sparse_gather.all_gather` (every peer receives every
payload exactly, all agree on whose count, each sums them in sorted peer order, so φ is
bit-identical everywhere), or, when the gather would cost more bytes than a dense all-reduce at the
round's N peers (N·payload > 8·M, i.e. N > ~290 at 1.56%, twice that for the per-index mean —
sparse_gather.py's docstring), a dense all-reduce of the decoded ŝ.

Defaults, and where they come from. The paper's own repository (tplr-ai/SparseLoCo, now
one-covenant/SparseLoCo) was not reachable from here; its public precursor by the same authors,
tplr-y/CCLoco (`src/tplr/ccloco.py`, `hparams/*/sweeps/ccloco.yaml`), and Templar's production
settings, tplr-ai/templar (`hparams/hparams.json`, `src/tplr/compress/topk.py`), were. Theirs, ours:
- chunk C = 4096, k = 64 (density 1.5625%): Covenant-72B (docs/algorithms.md; the paper's 1–3%).
  CCLoco's sweeps and templar chunk 2-D weights into 64×64 = 4096-value squares with k = 32 (0.78%);
  we chunk each tensor's flattened values contiguously (a short last chunk keeps ceil(k·L/C)).
  CCLoco chunks 1-D tensors (biases, norm gains) by 64 and keeps k = 32 of each ("rate_1d": 50%);
  ours keep ceil(k·L/C) — 1 of a 64-vector — unless `vector_k` is set (below).
- β: CCLoco's sweeps 0.95 (`error_decay`; the class default 0.999), templar 0.999
  (`momentum_decay`). **Ours 0.9**, from scripts/studies/sweep_sparseloco.py (below).
- α (outer lr) = 1.0: CCLoco's sweeps (`outer_learning_rate: 1`; its DiLoCo baseline 0.5 with
  Nesterov); templar 0.9; Covenant 1, later 0.65.
- 2-bit values: the paper. The quantiser is the reference's statistical one (sparse_codec.py);
  the reference code's default is 8 bits at a 6σ range, ours 2 bits at 4σ.
- H: the paper sweeps 15–250; Covenant and templar ran 30, CCLoco's sweeps 15. Our default 30.
- Aggregation: the reference code averages each index over the peers that selected it
  (CCLoco and templar: `scatter_reduce(..., reduce="mean", include_self=False)`) — our default,
  `aggregate="index_mean"`. The paper's equation (and docs/algorithms.md) write the plain mean over
  the R peers, (1/R)·Σ_r, which dilutes an index sent by one peer of R by R: `aggregate="mean"`.
  On our testbed (4 peers, small GPT, H 25, in-process, 400 steps) index_mean reached 2.073 and
  mean 2.220 held-out loss, DiLoCo 2.018 — the source (code) wins.

The sweep (scripts/studies/sweep_sparseloco.py: bench_convergence's testbed — 4 peers, small GPT, H 25,
inner AdamW 2e-3 — in one process, 600 steps; gap = SparseLoCo / DiLoCo(H 25, Nesterov 0.7/0.9) − 1
on the same seed). Seed 0 alone, one knob at a time from β 0.95, α 1, 4σ, C 4096, k 64: β 0.95
+2.7%, β 0.9 +0.4%, β 0.99 +6.2%; α 0.7 +3.8%, α 1.5 +5.7%; range 3σ +3.1%, 6σ +5.1%; C 256 / k 4
(same density) +2.4%; vector_k 8 +2.1% (58× fewer bytes than DiLoCo instead of 63×), vector_k 16
+1.7% (52×). Then seeds 0 and 1: β 0.9 −0.5% ± 1.3, β 0.8 −1.1% ± 1.6, β 0.9 with vector_k 8
−0.7% ± 0.5 (± the spread across seeds). β had the largest effect at 600 steps (2.3 points on
seed 0, more than that spread); β 0.8 and vector_k did not beat β 0.9 by more than the spread.
At bench_convergence's size (4 peer processes, 2000 steps), `sparseloco_vs_diloco` with β 0.9:
seed 0 +1.58% (again: +1.46%), seed 1 −0.51%, seed 2 −1.16% — mean −0.03% ± 1.4%, the target
(≤ 1%) met on the mean and on two seeds of three. There β 0.95 did as well: seed 0 +1.4% and +3.1%
(two earlier runs), seed 1 −0.74%, seed 2 −0.91%; β 0.8 seed 0 +1.21%; vector_k 8 seed 0 +1.29%
(58× fewer bytes). These differences are inside the run-to-run spread of one seed (~0.5%: the
multi-process runs are not bit-reproducible), and the seed-to-seed spread of the gap (~1.4%) is as
large as the target. So β 0.9 is the default because it was better at 600 steps and no worse at
2000; at 2000 steps no knob we tried beats the noise, and seed 0 stays ~1.2–1.6% behind DiLoCo.
Numbers: docs/bench/bench_convergence_sparseloco_seeds.json.

Identity (tests/test_outer_sparseloco.py): with k = C (density 1), no quantisation (bits None) and
β = 0, SparseLoCo is DiLoCo with outer momentum 0 and the same lr, bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Self

import torch
import trio

from meshtrain.collective.contract import Collective, GatherResult, ReduceResult, RoundRequest
from meshtrain.collective.sparse_codec import ChunkedTopK
from meshtrain.collective.sparse_gather import all_gather
from meshtrain.log import get_logger, kv
from meshtrain.optim.outer import OuterOptimizer, OuterSpec

log = get_logger(__name__)

_MASK = "sent/"  # dense index_mean: key prefix of the "sent" indicator (names never contain "/")
_SEP = "|"  # payload keys are "<parameter name>|<part>"; parameter names never contain "|"


class SparseLoCo(OuterOptimizer):
    """model, inner, collective: see `OuterOptimizer`.
    H: inner steps per round (30).
    lr: α, the outer SGD's step on the aggregated sparse update (1.0).
    beta: β, the error-feedback decay (0.9: the sweep in the module docstring; the reference 0.95);
        1 is classic error feedback, 0 none.
    chunk, k: top-k of every chunk of `chunk` values (4096, 64).
    bits: 2 (2-bit values) or None (float32 values).
    range_sigmas: the 2-bit quantiser's range in σ (4).
    aggregation: "auto" (all-gather unless a dense all-reduce costs fewer bytes at this N),
        "gather" or "allreduce".
    aggregate: "index_mean" (the reference code: each index averaged over the peers that sent it;
        default) or "mean" (the paper's equation, (1/R)·Σ).
    vector_k, vector_chunk: 1-D tensors (biases, norm gains) keep `vector_k` of every
        `vector_chunk` values (the reference code's "rate_1d"); None: as every other tensor.
    """

    spec_keys: ClassVar[frozenset[str] | None] = frozenset(("outer_lr", "error_decay", "sparse_k", "sparse_chunk"))

    # A spec's outer lr and β are this class's (1.0 and 0.9: the module docstring's sweep), not the
    # spec fields' defaults (0.7, which DiLoCo's specs keep, and 0.95, which no other optimizer reads).
    spec_defaults: ClassVar[Mapping[str, Any]] = {"outer_lr": 1.0, "error_decay": 0.9}
    unpaced_reason: ClassVar[str | None] = "its sparse gather weighs every payload alike, whatever each peer trained"
    ungrouped_reason: ClassVar[str | None] = (
        "its sparse exchange has no consensus term (a dense one would cost 50x its payload)"
    )
    not_robust_reason: ClassVar[str | None] = "gathers sparse payloads"

    @classmethod
    def check_spec(cls, spec: OuterSpec) -> None:
        if spec.sparse_k > spec.sparse_chunk:
            raise ValueError(f"sparse_k ({spec.sparse_k}) must be at most sparse_chunk ({spec.sparse_chunk})")

    @classmethod
    def from_spec(
        cls, model: torch.nn.Module, inner: torch.optim.Optimizer | None, collective: Collective, spec: OuterSpec
    ) -> Self:
        return cls(
            model,
            inner,
            collective,
            H=spec.H,
            lr=spec.outer_lr,
            beta=spec.error_decay,
            chunk=spec.sparse_chunk,
            k=spec.sparse_k,
        )

    def __init__(
        self,
        model: torch.nn.Module,
        inner: torch.optim.Optimizer | None,
        collective: Collective,
        *,
        H: int = 30,
        lr: float = 1.0,
        beta: float = 0.9,
        chunk: int = 4096,
        k: int = 64,
        bits: int | None = 2,
        range_sigmas: float = 4.0,
        aggregation: str = "auto",
        aggregate: str = "index_mean",
        vector_k: int | None = None,
        vector_chunk: int = 64,
    ) -> None:
        if not lr > 0:
            raise ValueError(f"outer lr must be > 0, got {lr}")
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta (error-feedback decay) must be in [0, 1], got {beta}")
        if aggregation not in ("auto", "gather", "allreduce"):
            raise ValueError(f"aggregation must be auto, gather or allreduce, got {aggregation!r}")
        if aggregate not in ("mean", "index_mean"):
            raise ValueError(f"aggregate must be mean or index_mean, got {aggregate!r}")
        super().__init__(model, inner, collective, H=H, codec="none")
        self.lr, self.aggregation, self.aggregate = lr, aggregation, aggregate
        self.sparse = ChunkedTopK(chunk=chunk, k=k, bits=bits, range_sigmas=range_sigmas)
        vector = (
            self.sparse
            if vector_k is None
            else ChunkedTopK(chunk=vector_chunk, k=vector_k, bits=bits, range_sigmas=range_sigmas)
        )
        self.error_feedback = beta
        self._shapes = {n: phi.shape for n, phi in self.outer_params.items()}
        # Every peer derives the same codec per tensor from the shapes alone, so layouts still agree.
        self.codecs = {n: vector if len(shape) <= 1 else self.sparse for n, shape in self._shapes.items()}
        self._sent: dict[tuple[str, ...], dict[str, torch.Tensor]] = {}  # ŝ decoded, until applied
        self.last_aggregation = ""

    def build_outer_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        # Plain SGD (no momentum: e plays it), foreach=False as DiLoCo, for the same bits everywhere.
        return torch.optim.SGD(params, lr=self.lr, momentum=0.0, foreach=False)

    # -- hooks -----------------------------------------------------------------------------------

    def compress(
        self, accumulated: dict[str, torch.Tensor], names: Sequence[str]
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        payload, decoded = self._encode(accumulated)
        self._sent[tuple(names)] = decoded
        return payload, decoded

    async def communicate(
        self, tensors: dict[str, torch.Tensor], *, round_id: int, tag: str, weight: float
    ) -> ReduceResult:
        if not any(_SEP in key for key in tensors):  # a joiner's weight-0 Δ: dense, not fed back
            tensors = (await trio.to_thread.run_sync(self._encode, tensors))[0]
        names = list(dict.fromkeys(key.rsplit(_SEP, 1)[0] for key in tensors))
        mode = self.choose_aggregation(len(self.collective.group(round_id)), names)
        self.last_aggregation = mode
        if mode == "allreduce":
            dense = await trio.to_thread.run_sync(self._decode_payload, tensors, names)
            if self.aggregate == "mean":
                return await self.collective.all_reduce(RoundRequest(dense, round_id, tag, weight=weight))
            # index_mean densely: the weighted means of the values and of "this peer sent index i";
            # their ratio is Σ w·v / Σ_{senders of i} w (bit-identical across peers, not to the gather).
            sent = {_MASK + n: (v != 0).to(torch.float32) for n, v in dense.items()}
            r = await self.collective.all_reduce(RoundRequest({**dense, **sent}, round_id, tag, weight=weight))
            mean = {
                n: torch.where(r.tensors[_MASK + n] > 0, r.tensors[n] / r.tensors[_MASK + n].clamp_min(1e-30), 0.0)
                for n in names
            }
            return ReduceResult(
                mean, r.contributors, r.digest, r.bytes_sent, r.bytes_received, dict(r.excluded), members=r.members
            )
        gathered = await all_gather(self.collective, tensors, round_id=round_id, tag=tag, weight=weight)
        mean = await trio.to_thread.run_sync(self._aggregate, gathered, names)
        if gathered.excluded:
            log.info(
                kv(
                    "sparse round without some peers",
                    round=round_id,
                    excluded=",".join(p[-8:] for p in sorted(gathered.excluded)),
                )
            )
        return ReduceResult(
            mean,
            gathered.contributors,
            b"",
            gathered.bytes_sent,
            gathered.bytes_received,
            dict(gathered.excluded),
            members=tuple(sorted({*gathered.weights, *gathered.excluded})),
        )

    def apply(self, result: ReduceResult, names: Sequence[str]) -> None:
        sent = self._sent.pop(tuple(names), None)
        if any(_SEP in key for key in result.tensors):
            # We proceeded alone (the collective failed): our own ŝ is the update.
            result = ReduceResult(
                sent if sent is not None else self._decode_payload(result.tensors, names), result.contributors, b""
            )
        elif sent is not None and self.collective.peer_id not in result.contributors:
            # The others could not count our ŝ (it did not reach them all): keep it for next time.
            for n in names:
                self.residual[n].add_(sent[n])
        super().apply(result, names)

    # -- aggregation -------------------------------------------------------------------------------

    def choose_aggregation(self, n: int, names: Sequence[str]) -> str:
        """ "gather" or "allreduce" for a round of `n` peers (sparse_gather.py's byte count)."""
        if self.aggregation != "auto":
            return self.aggregation
        numel = sum(self.outer_params[x].numel() for x in names)
        payload = sum(self.codecs[x].encoded_nbytes(self.outer_params[x].numel()) for x in names)
        # gather: (n−1)·payload; all-reduce: 2·(n−1)/n·4·M, twice that for index_mean (values + mask)
        dense_factor = 8 if self.aggregate == "mean" else 16
        return "gather" if n * payload <= dense_factor * numel else "allreduce"

    def _encode(self, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        payload: dict[str, torch.Tensor] = {}
        decoded: dict[str, torch.Tensor] = {}
        for n, t in tensors.items():
            parts = self.codecs[n].encode(t)
            decoded[n] = self.codecs[n].decode(parts, self._shapes[n])
            payload.update({f"{n}{_SEP}{k}": v for k, v in parts.items()})
        return payload, decoded

    def _parts(self, payload: dict[str, torch.Tensor], n: str) -> dict[str, torch.Tensor]:
        prefix = n + _SEP
        return {k[len(prefix) :]: v for k, v in payload.items() if k.startswith(prefix)}

    def _decode_payload(self, payload: dict[str, torch.Tensor], names: Sequence[str]) -> dict[str, torch.Tensor]:
        return {n: self.codecs[n].decode(self._parts(payload, n), self._shapes[n]) for n in names}

    def _aggregate(self, gathered: GatherResult, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """The same bits on every peer: fixed (sorted) peer order, elementwise fp32 arithmetic,
        the operations of the all-reduce's reduction (`acc.add_(x, alpha=w)`, then `div_`)."""
        peers = sorted(gathered.payloads)
        total = sum(gathered.weights[p] for p in peers)
        out: dict[str, torch.Tensor] = {}
        for n in names:
            numel = self.outer_params[n].numel()
            acc = torch.zeros(numel)
            count = torch.zeros(numel) if self.aggregate == "index_mean" else None
            for p in peers:
                w = gathered.weights[p]
                if not w:
                    continue
                where, values = self.codecs[n].decode_sparse(self._parts(gathered.payloads[p], n), numel)
                dense = torch.zeros(numel)
                dense[where] = values
                acc.add_(dense, alpha=w)
                if count is not None:
                    count[where] += w
            if count is not None:
                acc.div_(count.clamp_min(1e-30)).masked_fill_(count == 0, 0.0)
            elif total:
                acc.div_(total)
            out[n] = acc.view(self._shapes[n])
        return out
