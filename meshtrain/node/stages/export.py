"""`meshtrain export` of a pipeline swarm: any peer assembles the whole model from every stage.

Problem. A pipeline swarm's peer (node/stages/peer.py) holds one stage of the spec's model; its
checkpoints hold that stage only. The model the swarm trains exists nowhere in one piece, yet a
user wants one file they can load — the way Universal Checkpointing reshapes a checkpoint saved
under one parallel layout into another, here from S stages into one model.

Design. The running daemon is the one that can do it: it is an admitted, connected swarm member
and already downloads stages from their replicas (node/stages/state.py). So the export runs in the
daemon (`PipelineExporter`), asked through the local status server:
1. One step for every stage. `PipelinePeer.request_epoch_end` makes the origins end the running
   epoch after its current iteration; every peer publishes its stage at that one swarm step
   (what late joiners download). We wait up to `EPOCH_END_WAIT` seconds for our own publish; if
   the swarm does not end the epoch by then (it waits for a stage's peer, say), each stage's
   newest published state is taken as it is.
2. Fetch. Our stage comes from our own published state; every other stage from its replicas,
   the peers that announce it and offer a state (we wait, within the same deadline, until every
   one of them offers the step we published at), by state_sync's majority vote on identical
   manifests (`StageStates.fetch_required`). Replicas that disagree are an error naming the
   stage, never replaced by an older snapshot. A stage with no replica left is taken from the
   newest snapshot a peer that held it before still serves (trusted: nobody outvotes it;
   recorded as "former replica").
3. Assemble (`assemble`). The spec's model is built (a built-in GPT, or a transformers
   model of a family models/staged.py cuts), and each stage's weights must be exactly the
   parameters the spec's cut (`stage_cut`) gives that stage — names and shapes — and together
   cover every parameter once (`pipeline.stages.load_stage_states`). Weights are the stage's φ
   when its replicas sync by DiLoCo / NoLoCo (what the swarm agreed on, as in export.py), the
   stage's weights with every-step sync.
4. Write with export.py's writer (beside the target, renamed into place; an hf model with its own
   `save_pretrained`, so `AutoModelForCausalLM.from_pretrained(out)` loads it): the same layout and
   `meshtrain_export.json`, plus `stages`: for each stage its step, where it came from ("own",
   "replicas", "former replica", "checkpoint"), how many donors agreed and the blake3 digest of
   its weights (`weights_digest`: the tensors in name order, raw bytes). `step` is the lowest
   stage step; `steps_agree` says whether every stage was at the same step.

Wire (node/status/client.py): `POST /export?out=<absolute path>` with the node's control token starts
the export in the daemon (202; 400 with the reason if it cannot start: not a pipeline swarm,
another export running, the target not free). `GET /status` shows it as `pipeline.export`:
`{state: running|done|failed, out, phase, stages: {stage: {done, total}}, result | error}`.
`export_pipeline` (the Python API and the CLI) is that client: it polls the status document,
reports progress, and returns the result or raises.

Offline. With no daemon running on the data dir, `export_pipeline` assembles from the data dir's
own checkpoints (the newest of each stage; a peer that moved holds several stages) if they hold
every stage, and otherwise fails with one line naming the missing stages and saying to start the
node. It never writes a half export: every failure leaves the target untouched.

Failures (one line each, `MeshtrainError`): a stage whose replicas disagree (no majority), whose
donors all fail, or whom nobody serves (`StageStateError`, naming the stage); a state that is not
the stage's parameters (`ConfigError` naming the stage); the daemon stopping meanwhile.

Sample. `load_assembled` is `export_pipeline` into a temporary directory, read back into the
spec's model: `meshtrain sample` on a pipeline peer continues a prompt with the whole model.

Not here: a pipeline swarm of a model models/staged.py cannot cut (`swarm create` refuses one).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import blake3
import torch
import trio

from meshtrain.errors import ConfigError, MeshtrainError
from meshtrain.log import get_logger, kv
from meshtrain.models.sources import HFCausalLM, resolve_context
from meshtrain.models.staged import staged
from meshtrain.node.export import Trained, check_export_target, load_spec, spec_tokenizer, write_export
from meshtrain.node.spec.data_dir import CHECKPOINT_DIR
from meshtrain.node.spec.signed import SignedSpec
from meshtrain.node.stages.peer import PipelinePeer
from meshtrain.node.stages.trainer import checkpoint_stage
from meshtrain.node.state.checkpoint import CheckpointStore
from meshtrain.node.status.client import StatusError, fetch_status, read_daemon_file, request_export
from meshtrain.node.trainer import build_model
from meshtrain.pipeline.cut import parse_stage_cut
from meshtrain.pipeline.stages import StageError, load_stage_states

log = get_logger(__name__)

EPOCH_END_WAIT = 120.0  # seconds the exporter waits for the epoch end it asked for
EXPORT_TIMEOUT = 3600.0  # seconds `export_pipeline` waits for the daemon's export
POLL = 0.5  # seconds between two looks at the daemon's export progress


class ExportError(MeshtrainError):
    """The export could not be made; the message says why (and, for a stage, which)."""


def stage_weights(state: Mapping[str, Any], stage: int) -> dict[str, torch.Tensor]:
    """A stage's exported weights from its published state or checkpoint: φ when its replicas
    sync by an outer optimizer (`outer.outer_params`), else its weights."""
    outer = state.get("outer")
    weights = outer.get("outer_params") if isinstance(outer, dict) else state.get("weights")
    if not isinstance(weights, dict) or not all(isinstance(t, torch.Tensor) for t in weights.values()):
        raise ConfigError(f"stage {stage}'s state holds no weights")
    return weights


def weights_digest(weights: Mapping[str, torch.Tensor]) -> str:
    """blake3 of a stage's weights: the tensors in name order, their raw bytes."""
    h = blake3.blake3()
    for name in sorted(weights):
        h.update(weights[name].detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class StageSource:
    """Where one stage of an export came from (`meshtrain_export.json`'s `stages`)."""

    stage: int
    step: int
    round: int  # the stage's outer rounds (diloco / noloco replica sync; 0 with every-step)
    source: str  # "own", "replicas", "former replica", "checkpoint"
    donors: int
    digest: str

    @classmethod
    def of(cls, stage: int, step: int, state: Mapping[str, Any], source: str, donors: int) -> StageSource:
        """The record of stage `stage`'s `state` (published, downloaded or checkpointed) at `step`."""
        outer = state.get("outer")
        rounds = outer.get("rounds") if isinstance(outer, dict) else 0
        digest = weights_digest(stage_weights(state, stage))
        return cls(stage, step, rounds if isinstance(rounds, int) else 0, source, donors, digest)


def assemble(signed: SignedSpec, weights: Mapping[int, Mapping[str, torch.Tensor]]) -> tuple[torch.nn.Module, Any]:
    """The spec's model with every stage's weights (module docstring, 3) and its tokenizer.
    ConfigError naming the stage whose weights are missing or not its parameters."""
    spec = signed.spec
    tokenizer = spec_tokenizer(signed)
    model = build_model(spec, tokenizer.vocab_size)
    view = staged(model)
    cut = (
        parse_stage_cut(spec.pipeline.stage_cut, spec.pipeline.stages, view.n_layer)
        if spec.pipeline.stage_cut
        else None
    )
    stages = view.stages(spec.pipeline.stages, cut)
    missing = [s for s in range(spec.pipeline.stages) if s not in weights]
    if missing:
        raise ConfigError(f"no weights for stage(s) {', '.join(map(str, missing))}")
    for st in stages:
        have, want = set(weights[st.index]), set(st.parameter_names)
        if have != want:
            odd = sorted(have ^ want)
            raise ConfigError(
                f"stage {st.index}'s state does not hold the parameters the spec's cut gives it (e.g. {odd[0]})"
            )
    try:
        load_stage_states(model, [weights[s] for s in range(spec.pipeline.stages)])
    except StageError as e:
        raise ConfigError(f"the stages do not assemble into the spec's model: {e}") from None
    model.eval()
    return model, tokenizer


def write_assembled(
    signed: SignedSpec,
    weights: Mapping[int, Mapping[str, torch.Tensor]],
    sources: list[StageSource],
    out: str | os.PathLike[str],
) -> dict[str, Any]:
    """Assemble and write the export (module docstring, 3-4); what `meshtrain_export.json` says."""
    model, tokenizer = assemble(signed, weights)
    steps = [s.step for s in sources]
    context = resolve_context(model, signed.spec.model.context, signed.spec.model.source)
    trained = Trained(signed, min(steps), min(s.round for s in sources), model, tokenizer, context)
    extra = {
        "pipeline": signed.spec.pipeline.kind,
        "stage_cut": signed.spec.pipeline.stage_cut,
        "steps_agree": len(set(steps)) == 1,
        "stages": [asdict(s) for s in sorted(sources, key=lambda s: s.stage)],
    }
    return write_export(trained, out, extra)


# -- in the daemon ---------------------------------------------------------------------------------


class PipelineExporter:
    """The daemon's side (module docstring, 1-4): `start(out)` begins an export in `nursery`;
    its progress is `peer.export` (the status document's `pipeline.export`).

    peer: the node's `PipelinePeer`. signed: the swarm's spec. nursery: where exports run (the
    node's; an export ends with it).
    """

    def __init__(self, peer: PipelinePeer, signed: SignedSpec, nursery: trio.Nursery) -> None:
        self.peer = peer
        self.signed = signed
        self.nursery = nursery

    def start(self, out: str) -> dict[str, Any]:
        """Begin exporting into `out` (an absolute path, free); the initial progress. On the trio
        thread. ConfigError if it cannot start."""
        if not os.path.isabs(out):
            raise ConfigError(f"export target {out!r} must be an absolute path")
        target = check_export_target(out)
        current = self.peer.export
        if current is not None and current["state"] == "running":
            raise ConfigError(f"an export into {current['out']} is running; wait for it to finish")
        self.peer.export = {"state": "running", "out": str(target), "phase": "starting", "stages": {}}
        self.nursery.start_soon(self._run, target)
        return dict(self.peer.export)

    async def _run(self, target: Path) -> None:
        progress = self.peer.export
        assert progress is not None
        try:
            result = await self.export(target, progress)
        except MeshtrainError as e:
            log.warning(kv("export failed", out=str(target), error=str(e)[:300]))
            self.peer.export = {**progress, "state": "failed", "error": str(e)}
            return
        log.warning(kv("exported the assembled model", out=str(target), step=result["step"]))
        self.peer.export = {**progress, "state": "done", "phase": "written", "result": result}

    async def export(self, target: Path, progress: dict[str, Any]) -> dict[str, Any]:
        """Steps 1-4 of the module docstring; `progress` is updated as it goes."""
        peer, spec = self.peer, self.signed.spec
        progress["phase"] = "waiting for every stage to publish at one step (the epoch's end)"
        before = peer.request_epoch_end()
        deadline = trio.current_time() + EPOCH_END_WAIT  # for the epoch end and the replicas' offers
        with trio.move_on_at(deadline):
            while peer.states.published is None or peer.states.published.count <= before:
                await trio.sleep(POLL / 5)
        own = peer.states.published
        weights: dict[int, dict[str, torch.Tensor]] = {}
        sources: list[StageSource] = []
        if own is not None:
            weights[own.stage] = stage_weights(own.state, own.stage)
            sources.append(StageSource.of(own.stage, own.step, own.state, "own", 1))
        step = own.step if own is not None else 0
        for stage in range(spec.pipeline.stages):
            if stage in weights:
                continue
            # The others publish at the same epoch end as we did; their `offer` reaches us with
            # their next membership heartbeat.
            progress["phase"] = f"waiting for stage {stage}'s replicas to offer step {step}"
            with trio.move_on_at(deadline):
                while peer.handover.donors(stage, step)[1]:
                    await trio.sleep(POLL / 5)
            replicas, _, others = peer.handover.donors(stage, step)
            progress["phase"] = f"fetching stage {stage} from {len(replicas)} replica(s)"
            bar = progress["stages"].setdefault(str(stage), {"done": 0, "total": 0})

            def report(done: int, total: int, bar: dict[str, int] = bar) -> None:
                bar["done"], bar["total"] = done, total

            # A stage with replicas is theirs or nothing: when they disagree, a former replica's
            # older snapshot would be a silent substitute. Without replicas it is all there is.
            fallback = [] if replicas else others
            donated = await peer.states.fetch_required(stage, replicas, fallback, progress=report)
            weights[stage] = stage_weights(donated.state, stage)
            source = "replicas" if donated.from_replicas else "former replica"
            sources.append(StageSource.of(stage, donated.step, donated.state, source, len(donated.donors)))
        progress["phase"] = "assembling and writing"
        return await trio.to_thread.run_sync(write_assembled, self.signed, weights, sources, target)


# -- the client: the Python API and `meshtrain export` ---------------------------------------------


def export_pipeline(
    data_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    progress: Callable[[dict[str, Any]], Any] | None = None,
    timeout: float = EXPORT_TIMEOUT,
) -> dict[str, Any]:
    """Export the whole model of the pipeline swarm whose peer's data dir is `data_dir` into the
    new directory `out`; returns what `meshtrain_export.json` says, and `out`.

    With the peer's daemon running, it does the export (module docstring) and this call waits
    for it, calling `progress(pipeline.export)` at every look; without one, the data dir's own
    checkpoints must hold every stage. Raises `ConfigError` or `ExportError` with one line that
    says what is wrong (which stage, what to do); nothing is written then."""
    signed = load_spec(data_dir)
    if signed.spec.pipeline.kind == "none":
        raise ConfigError(f"{data_dir} is not a pipeline swarm's peer; use export.export_model")
    target = check_export_target(out).resolve()
    try:
        daemon = read_daemon_file(data_dir)
    except StatusError:
        return export_offline(data_dir, target, signed)
    url = str(daemon.get("status_url") or "")
    try:
        token = Path(str(daemon.get("token_file"))).read_text().strip()
        request_export(url, token, str(target))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = ((fetch_status(url).get("pipeline") or {}).get("export")) or {}
            if state.get("out") == str(target):
                if progress is not None:
                    progress(state)
                if state.get("state") == "done":
                    return dict(state["result"])
                if state.get("state") == "failed":
                    raise ExportError(f"the node could not export: {state.get('error')}")
            time.sleep(POLL)
    except OSError as e:
        raise ExportError(f"cannot ask the running node to export ({e})") from None
    except StatusError as e:
        raise ExportError(f"the running node did not export: {e}") from None
    raise ExportError(f"the node's export did not finish within {timeout:.0f} s; see its status page")


def load_assembled(
    data_dir: str | os.PathLike[str], *, progress: Callable[[dict[str, Any]], Any] | None = None
) -> Trained:
    """The whole model of the pipeline swarm whose peer's data dir is `data_dir`, as `export.
    load_trained` gives a data-parallel swarm's φ (for `meshtrain sample`): `export_pipeline`
    into a temporary directory beside the data dir, read back, removed. Its errors."""
    import tempfile

    from huggingface_hub import load_torch_model

    signed = load_spec(data_dir)
    with tempfile.TemporaryDirectory(prefix=".assembled-", dir=Path(data_dir).expanduser()) as tmp:
        info = export_pipeline(data_dir, Path(tmp) / "model", progress=progress)
        tokenizer = spec_tokenizer(signed)
        model = build_model(signed.spec, tokenizer.vocab_size)
        if isinstance(model, HFCausalLM):
            # Written by the model's own save_pretrained, which may convert weights on the way out
            # (transformers 5 writes a mixture of experts' fused expert weights one expert per
            # tensor): read back by from_pretrained, which converts them in again.
            from transformers import AutoModelForCausalLM

            written = AutoModelForCausalLM.from_pretrained(
                str(Path(tmp) / "model"), local_files_only=True, use_kernels=False
            )
            model.inner.load_state_dict(written.state_dict())
        else:
            load_torch_model(model, Path(tmp) / "model")
    model.eval()
    return Trained(signed, int(info["step"]), 0, model, tokenizer, int(info["context"]))


def export_offline(data_dir: str | os.PathLike[str], out: Path, signed: SignedSpec) -> dict[str, Any]:
    """No daemon: assemble from the data dir's checkpoints, the newest of each stage, if they hold
    every stage; else ExportError naming the missing stages."""
    store_dir = Path(data_dir).expanduser() / CHECKPOINT_DIR
    newest: dict[int, tuple[int, dict[str, Any]]] = {}
    if store_dir.is_dir():
        store = CheckpointStore(store_dir, readonly=True)
        for path in store.list():
            ckpt = store.load(path)
            stage = checkpoint_stage(ckpt.state, signed.spec)
            if stage is not None and ckpt.step >= newest.get(stage, (-1, {}))[0]:
                newest[stage] = (ckpt.step, ckpt.state)
    missing = [s for s in range(signed.spec.pipeline.stages) if s not in newest]
    if missing:
        held = ", ".join(map(str, sorted(newest))) or "none"
        raise ExportError(
            f"no node is running with data dir {data_dir}, and its checkpoints hold stage(s) {held} only: "
            f"stage(s) {', '.join(map(str, missing))} live on other peers; start this node "
            "(`meshtrain node start`) and export again: the running node fetches them from their replicas"
        )
    weights = {s: stage_weights(state, s) for s, (_, state) in newest.items()}
    sources = [StageSource.of(s, step, state, "checkpoint", 1) for s, (step, state) in newest.items()]
    return write_assembled(signed, weights, sources, out)
