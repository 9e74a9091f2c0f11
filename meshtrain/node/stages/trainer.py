"""One pipeline stage as a peer trains it: `StageTrainer`, for node/stages/peer.py.

A pipeline peer holds one stage of the spec's model (a built-in GPT or a
transformers causal LM that models/staged.py cuts). `StageTrainer` is that stage: the locally built whole
model and its `StageReplica` (pipeline/stages.py), the optional per-stage outer
sync (pipeline/replica_sync.py: DiLoCo or NoLoCo among the stage's replicas), the step counter and
the numbers the status page shows. It has the stage's state in three forms:
- `checkpoint_state()` / `load_checkpoint()`: what a peer saves of its own stage (weights, AdamW,
  the outer optimizer's state, the step; `checkpoint_stage` tells which stage a checkpoint holds);
- `donated_state()` / `enter_donated()`: what a peer taking the stage over downloads from its
  replicas (node/stages/state.py): every-step, weights + AdamW; diloco / noloco, the outer state,
  entered with `OuterOptimizer.join`;
- `weights_digest()`: blake3 of the weights (replicas compare it after a DiLoCo round).

Devices and precision (node/ranks/devices.py, as the data-parallel trainer): the stage lives on
`device` (the node's `--device`), which must hold its weights, gradients and AdamW state
(`check_fits`, said before the stage moves there), and computes its forwards in the spec's
precision (`Precision`: bf16 autocast, fp32 master weights; fp32). Every form of its state is host
tensors: checkpoints load on any device, and downloads cross the data plane.

`needs_state` is True while the stage holds θ0 without having been given the swarm's state: right
at the swarm's step 0 only. Not here: when a stage is taken or its state fetched (pipeline_peer).
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import blake3
import torch

from meshtrain.models.sources import resolve_context
from meshtrain.models.staged import staged
from meshtrain.node.ranks.devices import Precision, check_fits, resolve_device, to_host
from meshtrain.node.spec.swarm import SwarmSpec
from meshtrain.node.trainer import StepInfo, build_model
from meshtrain.optim.outer import OuterStateError, StaleStateError
from meshtrain.optim.outer_state import OptimizerLayout
from meshtrain.pipeline.cut import parse_stage_cut
from meshtrain.pipeline.replica_sync import StageOuterSync
from meshtrain.pipeline.stages import StageReplica
from meshtrain.transport.validate import is_int


class StageTrainer:
    """This peer's stage: the (locally built, whole) model, its `StageReplica`, the optional
    per-stage outer sync, the step counter and the numbers the status page shows.

    spec: the swarm's. stage: which stage. vocab_size: the tokenizer's.
    device: where the stage trains (default: `resolve_device("auto")`, as the trainer's).
    """

    def __init__(self, spec: SwarmSpec, stage: int, vocab_size: int, device: torch.device | None = None) -> None:
        model = build_model(spec, vocab_size)
        cuttable = staged(model)  # ConfigError for a model a pipeline cannot cut
        self.spec = spec
        self.stage = stage
        self.device = device if device is not None else resolve_device("auto")
        self.context = resolve_context(model, spec.model.context, spec.model.source)
        S = spec.pipeline.stages
        cut = parse_stage_cut(spec.pipeline.stage_cut, S, cuttable.n_layer) if spec.pipeline.stage_cut else None
        check_fits(cuttable.stages(S, cut)[stage].module, self.device)  # before the stage moves there
        self.replica = StageReplica(
            model,
            S,
            stage,
            lr=spec.outer.inner_lr,
            weight_decay=spec.outer.weight_decay,
            clip=spec.outer.clip,
            cut=cut,
            device=self.device,
            compute_dtype=Precision(spec.model.precision, self.device).dtype,
        )
        self.sync: StageOuterSync | None = None
        self.step = 0
        self.needs_state = True  # fresh: θ0 of this stage, right only at the swarm's step 0
        self.info = StepInfo()
        self.lock = threading.Lock()
        self.bytes_sent = 0
        self.bytes_received = 0

    def attach_sync(self, current_collective: Any) -> StageOuterSync | None:
        """Build the spec's per-stage outer sync (None for "every-step") over the collective
        `current_collective()` returns."""
        spec = self.spec
        if spec.pipeline.replica_sync != "every-step" and self.sync is None:
            self.sync = StageOuterSync(
                self.replica,
                current_collective,
                spec.pipeline.replica_sync,  # type: ignore[arg-type]
                H=spec.outer.H,
                lr=spec.outer.outer_lr,
                momentum=spec.outer.outer_momentum if spec.pipeline.replica_sync == "diloco" else None,
                codec=spec.outer.codec,
            )
        return self.sync

    @property
    def rounds(self) -> int:
        return self.sync.outer.rounds if self.sync is not None else 0

    # -- state -----------------------------------------------------------------------------------

    def checkpoint_state(self) -> dict[str, Any]:
        """This stage's weights, AdamW state, outer state and step (host copies; between iterations)."""
        r = self.replica
        state: dict[str, Any] = {
            "pipeline": {"stage": self.stage, "stages": self.spec.pipeline.stages, "cut": self.spec.pipeline.stage_cut},
            "step": self.step,
            "weights": r.stage_state(),
            "adam": to_host(r.optimizer.state_dict()),
            "loss": self.info.loss,
        }
        if self.sync is not None:
            state["outer"] = self.sync.outer.state_dict(inner=False)
        return state

    def donated_state(self) -> dict[str, Any]:
        """What a peer taking this stage over downloads from us (node/stages/state.py): every-step,
        the weights and AdamW state; diloco / noloco, the outer state (φ and momentum). Host copies."""
        if self.sync is None:
            return {"weights": self.replica.stage_state(), "adam": to_host(self.replica.optimizer.state_dict())}
        return {"outer": self.sync.outer.state_dict(inner=False)}

    def enter_donated(self, state: dict[str, Any], *, at_step: int) -> None:
        """Take a downloaded `donated_state()` and train on from `at_step`, the epoch's base step.
        Raises `ValueError` for a state that does not fit this stage (nothing is changed then,
        except with an outer state the optimizer refuses half-way, which raises too)."""
        r = self.replica
        if self.sync is None:
            weights, adam = state.get("weights"), state.get("adam")
            if not (
                isinstance(weights, dict)
                and isinstance(adam, dict)
                and set(weights) == set(r.names)
                and all(
                    isinstance(weights[n], torch.Tensor) and weights[n].shape == p.shape
                    for n, p in zip(r.names, r.params, strict=True)
                )
            ):
                raise ValueError("the donated weights are not this stage's")
            try:  # checked whole first: a state that loads may still fail at the next step
                OptimizerLayout.of(r.optimizer).check(adam, "the donated AdamW state")
            except OuterStateError as e:
                raise ValueError(f"{e} (not this stage's)") from None
            saved = copy.deepcopy(r.optimizer.state_dict())
            try:
                r.optimizer.load_state_dict(adam)
            except (KeyError, TypeError, ValueError) as e:
                r.optimizer.load_state_dict(saved)
                raise ValueError(f"the donated AdamW state does not fit this stage: {e}") from None
            with torch.no_grad():
                for name, p in zip(r.names, r.params, strict=True):
                    p.copy_(weights[name])
        else:
            outer = state.get("outer")
            if not isinstance(outer, dict):
                raise ValueError("the donated state has no outer state")
            try:
                try:
                    self.sync.outer.join(outer, at_step=at_step)
                except StaleStateError:  # older than the round we enter: its φ is still the best we have
                    self.sync.outer.join(outer)
            except OuterStateError as e:
                raise ValueError(f"the donated outer state does not fit this stage: {e}") from None
        self.step = at_step
        self.needs_state = False

    def load_checkpoint(self, state: dict[str, Any]) -> None:
        r = self.replica
        with torch.no_grad():
            for name, p in zip(r.names, r.params, strict=True):
                p.copy_(state["weights"][name])
        r.optimizer.load_state_dict(state["adam"])
        self.step = int(state["step"])
        self.needs_state = False
        if self.sync is not None and "outer" in state:
            self.sync.outer.load_state_dict(state["outer"], inner=False)
        with self.lock:
            self.info.step = self.step
            self.info.loss = state.get("loss")

    def weights_digest(self) -> str:
        """blake3 of this stage's weights (replicas of a stage compare it after a DiLoCo round)."""
        h = blake3.blake3()
        for t in self.replica.stage_state().values():
            h.update(t.contiguous().numpy().tobytes())
        return h.hexdigest()


def checkpoint_stage(state: dict[str, Any], spec: SwarmSpec) -> int | None:
    """The stage a checkpoint holds, if it was made under this spec's cut (else None)."""
    meta = state.get("pipeline") if isinstance(state, dict) else None
    if (
        not isinstance(meta, dict)
        or meta.get("stages") != spec.pipeline.stages
        or meta.get("cut") != spec.pipeline.stage_cut
    ):
        return None
    stage = meta.get("stage")
    return stage if is_int(stage) and 0 <= stage < spec.pipeline.stages else None
