"""The trainer: one peer's model, data, inner optimizer and outer optimizer, glued per the spec.

Torch runs in a worker thread (`run` is called through `trio.to_thread.run_sync`); only the outer
optimizer's collective calls hop back onto the trio thread, so the network keeps flowing during
compute (`OuterOptimizer`'s threading bridge).

Data assignment is a pure function of (swarm seed, peer id, step) — `Corpus.batch` — as in
Psyche: peers train on different samples without coordinating, and a peer restarted from a
checkpoint at step s draws exactly the batches it would have drawn, so no work is repeated.

Models: the built-in GPT presets, any `torch.nn.Module` handed in through the Python API (its
`forward(x, y)` returns the loss, or an object with `.loss`), and Hugging Face `transformers`
causal-LM configs (`hf:<config.json>`, built from the config, never downloaded) when
transformers is installed.

State: `checkpoint_state()` (model θ, outer state with the inner optimizer) is what the node
saves; `donor_state()` (the outer state without the inner optimizer: φ, outer optimizer, step
counters) is what late joiners download — θ is φ after a round, and inner state is never shared
(ALGORITHMS.md).
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from meshtrain.collective import Collective
from meshtrain.errors import ConfigError
from meshtrain.log import get_logger, kv
from meshtrain.models import GPT, Corpus, GPTConfig
from meshtrain.node.config import SwarmSpec
from meshtrain.optim import DiLoCo, NoLoCo, OuterOptimizer, StreamingDiLoCo

log = get_logger(__name__)

OuterFactory = Callable[[torch.nn.Module, torch.optim.Optimizer, Collective], OuterOptimizer]


def load_corpus(spec: SwarmSpec) -> Corpus:
    if spec.dataset == "builtin":
        return Corpus.default()
    path = Path(spec.dataset).expanduser()
    if not path.is_file():
        raise ConfigError(f"dataset {path} does not exist on this machine (every peer needs the same file)")
    return Corpus.from_file(path)


def build_model(spec: SwarmSpec, vocab_size: int) -> torch.nn.Module:
    """The spec's model, initialised from the swarm seed: identical on every peer."""
    if spec.model.startswith("hf:"):
        return _hf_model(spec.model[3:], vocab_size, spec.seed)
    preset = {"gpt-tiny": GPTConfig.tiny, "gpt-small": GPTConfig.small, "gpt-large": GPTConfig.large}[spec.model]
    return GPT(preset(vocab_size), seed=spec.seed)


def _hf_model(config_path: str, vocab_size: int, seed: int) -> torch.nn.Module:
    try:
        import transformers
    except ImportError:
        raise ConfigError("model hf:... needs the `transformers` package: pip install transformers") from None
    try:
        data = json.loads(Path(config_path).expanduser().read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read Hugging Face config {config_path}: {e}") from None
    model_type = data.pop("model_type", None)
    if not model_type:
        raise ConfigError(f"{config_path}: a Hugging Face config needs a model_type (e.g. gpt2, llama)")
    data["vocab_size"] = vocab_size
    for special in ("bos_token_id", "eos_token_id", "pad_token_id"):  # the config's ids are for another vocab
        if not isinstance(data.get(special), int) or not 0 <= data[special] < vocab_size:
            data[special] = None
    config = transformers.AutoConfig.for_model(model_type, **data)
    torch.manual_seed(seed)
    return _HFCausalLM(transformers.AutoModelForCausalLM.from_config(config))


class _HFCausalLM(torch.nn.Module):
    """Adapts a transformers causal LM to `model(x, y) -> loss` (HF shifts labels itself, so it
    gets the inputs as labels: the same next-token objective)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        return self.inner(input_ids=x, labels=x).loss


def context_of(model: torch.nn.Module, default: int = 32) -> int:
    cfg = getattr(model, "config", None)
    if isinstance(cfg, GPTConfig):
        return cfg.context
    inner = getattr(model, "inner", None)
    n = getattr(getattr(inner, "config", None), "n_positions", None) or getattr(
        getattr(inner, "config", None), "max_position_embeddings", None)
    return min(int(n), 128) if n else default


def _loss_of(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.loss


@dataclass
class StepInfo:
    """What the trainer thread last published (read by the node for status and metrics)."""

    step: int = 0
    loss: float | None = None
    eval_loss: float | None = None
    samples_per_s: float = 0.0
    rounds: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)


class Trainer:
    """One peer's training. Build it on the trio thread; call `run` in a worker thread."""

    def __init__(self, spec: SwarmSpec, collective: Collective, peer_id: str, *,
                 model: torch.nn.Module | None = None, outer_factory: OuterFactory | None = None,
                 corpus: Corpus | None = None) -> None:
        self.spec = spec
        self.peer_id = peer_id
        self.corpus = corpus or load_corpus(spec)
        self.model = model if model is not None else build_model(spec, self.corpus.vocab_size)
        self.context = context_of(self.model)
        self.inner = torch.optim.AdamW(self.model.parameters(), lr=spec.inner_lr, weight_decay=spec.weight_decay)
        self.outer = (outer_factory or self._default_outer)(self.model, self.inner, collective)
        self._evals = self.corpus.eval_batches(spec.eval_batches, 32, self.context)
        self.info = StepInfo()
        self.lock = threading.Lock()  # guards `info` (written by the trainer thread)

    def _default_outer(self, model: torch.nn.Module, inner: torch.optim.Optimizer,
                       collective: Collective) -> OuterOptimizer:
        s = self.spec
        if s.optimizer == "diloco":
            return DiLoCo(model, inner, collective, H=s.H, lr=s.outer_lr, momentum=s.outer_momentum, codec=s.codec)
        if s.optimizer == "streaming":
            return StreamingDiLoCo(model, inner, collective, H=s.H, fragments=s.fragments, delay=s.delay,
                                   alpha=s.alpha, codec=s.codec if s.codec != "none" else "fp4", lr=s.outer_lr,
                                   momentum=s.outer_momentum)
        return NoLoCo(model, inner, collective, H=s.H, codec=s.codec)

    @property
    def step(self) -> int:
        return self.outer.inner_steps

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def evaluate(self) -> float:
        """Held-out loss of the outer parameters φ (what the swarm agrees on), not our replica."""
        self.model.eval()
        try:
            with self.outer.outer_weights(), torch.no_grad():
                losses = [float(_loss_of(self.model(x, y))) for x, y in self._evals]
        finally:
            self.model.train()
        return sum(losses) / len(losses)

    def run(self, stop: threading.Event, until: int, after_step: Callable[[Trainer], None]) -> None:
        """Train until `stop` is set, step `until` (0: forever) is reached, or the outer optimizer
        lost step with the swarm (`needs_resync`: the node downloads the state). Runs in a worker
        thread; `after_step(self)` is called from this thread after every step, between steps,
        where the state is consistent (checkpoints and donor snapshots are taken there)."""
        spec = self.spec
        window: list[float] = []
        t_last = time.monotonic()
        while not stop.is_set() and (until == 0 or self.step < until) and not self.outer.needs_resync:
            x, y = self.corpus.batch(spec.batch_size, self.context, seed=spec.seed, peer=self.peer_id,
                                     step=self.step)
            loss = _loss_of(self.model(x, y))
            self.outer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), spec.clip)
            self.outer.step()
            value = float(loss.detach())
            now = time.monotonic()
            window.append(now - t_last)
            t_last = now
            window = window[-20:]
            eval_loss = None
            if spec.eval_every and self.step % spec.eval_every == 0 and not self.outer.in_flight:
                eval_loss = self.evaluate()
            with self.lock:
                info = self.info
                info.step, info.loss, info.rounds = self.step, value, self.outer.rounds
                info.samples_per_s = spec.batch_size * len(window) / max(sum(window), 1e-9)
                if eval_loss is not None:
                    info.eval_loss = eval_loss
                if eval_loss is not None or self.step % 10 == 0:
                    st = self.outer.stats()
                    info.history.append({"step": self.step, "t": time.time(), "loss": value, "eval_loss": eval_loss,
                                         "bytes_sent": st["bytes_sent"], "bytes_received": st["bytes_received"]})
                    del info.history[:-500]
            if not math.isfinite(value):
                log.warning(kv("training loss is not finite", step=self.step))
            after_step(self)

    # -- state ----------------------------------------------------------------------------------

    def checkpoint_state(self) -> dict[str, Any]:
        """Everything to resume bit-exactly (copies; call between steps)."""
        return {"model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
                "outer": self.outer.state_dict(inner=True),
                "eval_loss": self.info.eval_loss}

    def load_checkpoint(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.outer.load_state_dict(state["outer"], inner=True)
        with self.lock:
            self.info.step, self.info.rounds = self.step, self.outer.rounds
            self.info.eval_loss = state.get("eval_loss")

    def donor_state(self) -> dict[str, Any]:
        """What a late joiner needs: the outer state without the inner optimizer."""
        return self.outer.state_dict(inner=False)

    def join(self, state: dict[str, Any], at_step: int | None = None) -> None:
        self.outer.join(state, at_step=at_step)
        with self.lock:
            self.info.step, self.info.rounds = self.step, self.outer.rounds
