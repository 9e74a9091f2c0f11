"""Where a swarm's model comes from (the spec's `model` key), what its context is, and the digest
that proves two peers start from the same θ0.

Sources (`parse_model_source`):

    gpt-tiny | gpt-small | gpt-large   the built-in GPT presets (models/gpt.py), initialised from the
                                       spec's seed by a private generator
    hf:<dir>                           a pretrained Hugging Face causal LM on disk:
                                       `AutoModelForCausalLM.from_pretrained(dir, local_files_only=True)`,
                                       fp32 master weights, in training mode (dropout on, as
                                       the config says); never downloaded, and without the Hub's
                                       kernels (`use_kernels=False`, below)
    hf-config:<config.json>            a Hugging Face causal LM with fresh weights from a config
                                       (its `model_type` picks the class), built under the spec's
                                       seed so every peer builds the same θ0; its vocab_size is
                                       the tokenizer's
    py:<module>:<factory>              your own `nn.Module`: `factory(vocab_size) -> nn.Module`,
                                       called under the spec's seed. <module> is a dotted module
                                       name importable on every peer (`py:mypkg.models:make`), or the
                                       path of a .py file (`py:models/mine.py:make`: any <module>
                                       ending in .py or holding a "/" is a path; meshtrain/pyref.py)
    user                               no model in the spec: each member builds its own in its
                                       own training loop (`meshtrain.Swarm`, node/user_loop.py);
                                       the daemon refuses to train it

The trainer's contract for a model is `model(x, y)` returning the loss (or an object with
`.loss`). Built-in GPTs and py: models meet it themselves; a Hugging Face model is wrapped in
`HFCausalLM`, which hands the inputs over as labels (HF shifts them itself). `meshtrain sample`
further needs `next_token_logits`: GPTs and HF models have it; a py: model's `forward(x)` (no
targets) must return the logits or an object with `.logits`.

Context (`resolve_context`): the sequence length the swarm trains on is the spec's `context`
when set, else the model's own limit — a GPT's `context`, an HF config's
`max_position_embeddings` / `n_positions` / `n_ctx`, or a `context` attribute on a py: model —
else `DEFAULT_CONTEXT` for a model that names no limit. Nothing is capped silently: a spec
context above the model's limit is a ConfigError. A built-in GPT takes the spec's context as its
number of positions (so it has no other limit). An HF model's own limit is often far beyond what
a swarm trains on (131,072 positions for Llama 3: one batch would not fit any GPU), so `swarm
create` pins `context` = `CONTEXT_CAP` in the spec of an hf: / hf-config: model whose config
allows more, and says so (`capped_context`); a spec signed with context 0 keeps meaning the
model's own limit.

Digests (`model_digest`, pinned in the signed spec at `swarm create`): what defines θ0 besides
the spec itself. `config=<hex>` over the preset's shape (built-ins), or the canonical config JSON
(hf-config:, hf: — the keys `transformers_version` and `_name_or_path`, which say who saved it,
not what it is, are left out); `weights=<hex>` over the weight files of an hf: directory
(safetensors, bin and their index, by name); `source=<hex>` over a py: factory's source file
and the factory's name (`PyRef.source_digest`; its own imports are not followed); nothing for
`user` (the members' φ parity is what binds them). `check_local_copy` recomputes both
digests from this peer's files and raises a one-line ConfigError naming what differs.

Failures: a missing path, a config with no model_type, a factory that is not callable or does
not return an `nn.Module`, a tokenizer vocabulary larger than a pretrained model's embedding:
ConfigError, one line. `transformers` is imported only for hf: and hf-config:.

`hf_config(value)` reads an hf: or hf-config: model's config without building it (models/staged.py
asks it whether a pipeline can cut the architecture).

Not here: tokenizers (models/tokenizers.py), data (meshtrain/data/), export (node/export.py),
cutting a model into pipeline stages (models/staged.py).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import blake3
import torch

from meshtrain.errors import ConfigError
from meshtrain.models.gpt import GPT, GPTConfig
from meshtrain.models.tokenizers import tokenizer_digest
from meshtrain.pyref import PREFIX as PY_PREFIX
from meshtrain.pyref import PyRef

PRESETS: dict[str, Callable[..., GPTConfig]] = {
    "gpt-tiny": GPTConfig.tiny,
    "gpt-small": GPTConfig.small,
    "gpt-large": GPTConfig.large,
}
DEFAULT_CONTEXT = 32  # the sequence length of a model that names no limit, when the spec names none
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")
# Config keys that record who saved a config, not what the model is.
UNPINNED_CONFIG_KEYS = ("transformers_version", "_name_or_path")
HF_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx")
CONTEXT_CAP = 2048  # `swarm create`'s context for an HF model that allows more (`capped_context`)
_DOMAIN = b"meshtrain/model/v1\n"

SourceKind = Literal["builtin", "hf", "hf-config", "py", "user"]
USER_LOOP = "user"  # the spec names no model: each member trains its own in its own loop


@dataclass(frozen=True)
class ModelSource:
    """A parsed spec `model` value.

    kind: builtin, hf, hf-config or py. value: the spec value as written.
    location: the preset name, the hf: directory, the config path, or the py: module / file.
    factory: the py: factory's name (None for the others).
    """

    kind: SourceKind
    value: str
    location: str
    factory: str | None = None

    @property
    def is_path(self) -> bool:
        """A py: source given as a file path (not a dotted module name)."""
        return self.kind == "py" and self.pyref().is_path

    def pyref(self) -> PyRef:
        return PyRef(self.value, self.location, str(self.factory))


def parse_model_source(value: str) -> ModelSource:
    """Parse a spec `model` value; ValueError (for the config validator) says what is allowed."""
    if value in PRESETS:
        return ModelSource("builtin", value, value)
    for prefix, kind in (("hf:", "hf"), ("hf-config:", "hf-config")):
        if value.startswith(prefix) and len(value) > len(prefix):
            return ModelSource(kind, value, value[len(prefix) :])  # type: ignore[arg-type]
    if value.startswith(PY_PREFIX):
        try:
            ref = PyRef.parse(value)
        except ValueError:
            raise ValueError("py: models are py:<module or file.py>:<factory function>") from None
        return ModelSource("py", value, ref.module, ref.name)
    if value == USER_LOOP:
        return ModelSource("user", value, value)
    raise ValueError(
        f"must be one of {', '.join(PRESETS)}, hf:<pretrained dir>, hf-config:<config.json>, "
        f"py:<module or file.py>:<factory> or {USER_LOOP} (your own loop, meshtrain.Swarm)"
    )


def _source(value: str) -> ModelSource:
    try:
        return parse_model_source(value)
    except ValueError as e:
        raise ConfigError(f"model {value!r}: {e}") from None


# -- building ----------------------------------------------------------------------------------


class HFCausalLM(torch.nn.Module):
    """Adapts a transformers causal LM to `model(x, y) -> loss` (HF shifts labels itself, so it
    gets the inputs as labels: the same next-token objective). `inner` is the HF model."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner: Any = inner  # a transformers PreTrainedModel (transformers is optional: untyped here)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        return self.inner(input_ids=x, labels=x).loss


def build_model(value: str, *, vocab_size: int, seed: int, context: int = 0) -> torch.nn.Module:
    """The model the spec value names, θ0 identical on every peer that holds the same files.
    vocab_size: the tokenizer's. context: the spec's (0: the model's own); a built-in GPT takes it
    as its number of positions."""
    src = _source(value)
    if src.kind == "builtin":
        config = PRESETS[src.location](vocab_size)
        if context:
            config = dataclasses.replace(config, context=context)
        return GPT(config, seed=seed)
    if src.kind == "hf":
        return _pretrained(src, vocab_size)
    if src.kind == "hf-config":
        return _from_config(src, vocab_size, seed)
    if src.kind == "user":
        raise ConfigError(
            f"model {USER_LOOP}: this swarm trains a model its members build in their own "
            f"loops (meshtrain.Swarm); `meshtrain node start` has none to train"
        )
    return _from_factory(src, vocab_size, seed)


def _transformers(value: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"model {value} needs the `transformers` package: pip install transformers") from None
    return transformers


def _hf_dir(src: ModelSource) -> Path:
    path = Path(src.location).expanduser()
    if path.is_file() and path.suffix == ".json":
        raise ConfigError(
            f"model {src.value}: hf: takes a pretrained model's directory; for fresh weights "
            f"from a config file say hf-config:{src.location}"
        )
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"model {src.value}: {path} is not a Hugging Face model directory (no config.json) "
            f"on this machine (every peer needs the same files at that path)"
        )
    return path


def _pretrained(src: ModelSource, vocab_size: int) -> torch.nn.Module:
    transformers = _transformers(src.value)
    path = _hf_dir(src)
    try:
        # fp32 master weights whatever the files' dtype (bf16 -> fp32 is exact). In training mode,
        # as every other source builds its model: from_pretrained returns it in eval mode, so the
        # model's dropout would act only after the first evaluation had switched it back.
        # Without the Hub's kernels, which transformers >= 5.25 swaps in by default: they are code
        # fetched from the Hub at run time (some with trust_remote_code), they differ by device, so
        # a CUDA peer and a CPU peer would compute different functions of the same θ (loss scoring
        # and spot checks compare peers), and a kernelized model re-kernelizes on every train/eval
        # switch, which fails on the scoring's meta-device copy.
        inner = (
            transformers.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, use_kernels=False)
            .float()
            .train()
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"model {src.value}: cannot load it: {str(e).splitlines()[0][:300]}") from None
    rows = inner.get_input_embeddings().num_embeddings
    if vocab_size > rows:
        raise ConfigError(
            f"model {src.value} embeds {rows} token ids but the tokenizer has {vocab_size}: "
            f"use the tokenizer the model was trained with (--tokenizer hf:{src.location})"
        )
    return HFCausalLM(inner)


def _read_config(src: ModelSource, path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"model {src.value}: {path} does not exist on this machine") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"model {src.value}: cannot read {path}: {e}") from None
    if not isinstance(data, dict) or not data.get("model_type"):
        raise ConfigError(
            f"model {src.value}: {path} needs a model_type (e.g. gpt2, llama) to be a Hugging Face config"
        )
    return data


def hf_config(value: str) -> dict[str, Any]:
    """The config of an hf: or hf-config: model, from its file alone (nothing is built): what a
    caller needs to know of the architecture before building it (models/staged.py)."""
    src = _source(value)
    if src.kind == "hf":
        return _read_config(src, _hf_dir(src) / "config.json")
    if src.kind == "hf-config":
        return _read_config(src, Path(src.location).expanduser())
    raise ConfigError(f"model {value} is not a Hugging Face model (hf:<dir> or hf-config:<config.json>)")


def _from_config(src: ModelSource, vocab_size: int, seed: int) -> torch.nn.Module:
    transformers = _transformers(src.value)
    data = _read_config(src, Path(src.location).expanduser())
    model_type = data.pop("model_type")
    data["vocab_size"] = vocab_size
    for special in ("bos_token_id", "eos_token_id", "pad_token_id"):  # ids of another vocabulary
        if not isinstance(data.get(special), int) or not 0 <= data[special] < vocab_size:
            data[special] = None
    try:
        config = transformers.AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"model {src.value}: {str(e).splitlines()[0][:300]}") from None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return HFCausalLM(transformers.AutoModelForCausalLM.from_config(config))


def _load_factory(src: ModelSource) -> Callable[..., Any]:
    factory = src.pyref().load()
    if not callable(factory):
        raise ConfigError(f"model {src.value}: {src.location}.{src.factory} is not a function")
    return factory


def _from_factory(src: ModelSource, vocab_size: int, seed: int) -> torch.nn.Module:
    factory = _load_factory(src)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = factory(vocab_size)
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"model {src.value}: {src.factory}(vocab_size) returned a {type(model).__name__}, not a torch.nn.Module"
        )
    return model


# -- context -----------------------------------------------------------------------------------


def context_limit(model: torch.nn.Module) -> int | None:
    """The longest sequence `model` accepts, if it says: a GPT's context, an HF config's
    position count, or a `context` attribute."""
    cfg = getattr(model, "config", None)
    if isinstance(cfg, GPTConfig):
        return cfg.context
    hf = getattr(getattr(model, "inner", model), "config", None)
    for key in HF_CONTEXT_KEYS:
        n = getattr(hf, key, None)
        if isinstance(n, int) and n > 0:
            return n
    n = getattr(model, "context", None)
    return n if isinstance(n, int) and n > 0 else None


def capped_context(value: str) -> tuple[int, int] | None:
    """(`CONTEXT_CAP`, the model's limit) for an hf: / hf-config: model whose config allows more
    positions than the cap, read from its config file alone; None for every other model."""
    if _source(value).kind not in ("hf", "hf-config"):
        return None
    config = hf_config(value)
    limit = next((n for key in HF_CONTEXT_KEYS if isinstance(n := config.get(key), int) and n > 0), None)
    return (CONTEXT_CAP, limit) if limit is not None and limit > CONTEXT_CAP else None


def resolve_context(model: torch.nn.Module, spec_context: int, value: str = "the model") -> int:
    """The sequence length to train on (module docstring, "Context")."""
    limit = context_limit(model)
    if spec_context:
        if limit is not None and spec_context > limit:
            raise ConfigError(f"swarm spec: context {spec_context} is longer than {value} allows ({limit} positions)")
        return spec_context
    return limit or DEFAULT_CONTEXT


def loss_of(out: Any) -> torch.Tensor:
    """The loss in what `model(x, y)` returned: the tensor itself, or its `.loss` (module docstring)."""
    return out if isinstance(out, torch.Tensor) else out.loss


def next_token_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Logits [B, vocab] for the token after `ids` [B, T] (for sampling)."""
    if isinstance(model, HFCausalLM):
        return model.inner(input_ids=ids).logits[:, -1]
    try:
        out = model(ids)
    except TypeError as e:
        raise ConfigError(
            f"this model cannot be sampled: its forward(x) failed ({e}); sampling needs forward(x) to return logits"
        ) from None
    logits = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise ConfigError(
            "this model cannot be sampled: forward(x) must return logits [batch, time, vocab] or an object with .logits"
        )
    return logits[:, -1]


# -- digests -----------------------------------------------------------------------------------


def _hex(*parts: bytes) -> str:
    h = blake3.blake3(_DOMAIN)
    for p in parts:
        h.update(len(p).to_bytes(8, "little") + p)
    return h.hexdigest()[:32]


def _canonical_config(data: dict[str, Any]) -> bytes:
    kept = {k: v for k, v in data.items() if k not in UNPINNED_CONFIG_KEYS}
    return json.dumps(kept, sort_keys=True, separators=(",", ":")).encode()


def _weights_digest(src: ModelSource, path: Path) -> str:
    files = sorted(f for f in path.iterdir() if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES))
    if not any(not f.name.endswith(".json") for f in files):
        raise ConfigError(f"model {src.value}: {path} holds no weights (*.safetensors or *.bin)")
    h = blake3.blake3(_DOMAIN + b"weights", max_threads=blake3.blake3.AUTO)
    for f in files:
        h.update(f.name.encode() + b"\0" + f.stat().st_size.to_bytes(8, "little"))
        h.update_mmap(f)
    return h.hexdigest()[:32]


def model_digest(value: str) -> str:
    """What the spec pins for model `value` (module docstring, "Digests"): comma-separated
    `part=<hex>` pairs, from files alone (nothing is built)."""
    src = _source(value)
    if src.kind == "builtin":
        shape = dataclasses.asdict(PRESETS[src.location](1))
        del shape["vocab_size"], shape["context"]  # the tokenizer's and the spec's
        return f"config={_hex(value.encode(), json.dumps(shape, sort_keys=True).encode())}"
    if src.kind == "hf-config":
        data = _read_config(src, Path(src.location).expanduser())
        return f"config={_hex(_canonical_config(data))}"
    if src.kind == "hf":
        path = _hf_dir(src)
        data = _read_config(src, path / "config.json")
        return f"config={_hex(_canonical_config(data))},weights={_weights_digest(src, path)}"
    if src.kind == "user":
        return ""  # trained in the members' own loops: parity over φ is what binds them
    return f"source={src.pyref().source_digest()}"


def check_local_copy(model: str, tokenizer: str, *, model_pin: str, tokenizer_pin: str) -> None:
    """Refuse to train unless this peer's model and tokenizer files match the swarm's pins
    (empty pins: an unpinned spec, nothing to check). Raises a one-line ConfigError naming the
    first difference."""
    if model_pin:
        mine = dict(p.split("=", 1) for p in model_digest(model).split(","))
        theirs = dict(p.split("=", 1) for p in model_pin.split(",") if "=" in p)
        for part in sorted(set(mine) | set(theirs)):
            if mine.get(part) != theirs.get(part):
                raise ConfigError(
                    f"model: your {model} differs from the swarm's ({part} digest "
                    f"{str(mine.get(part))[:12]} here, {str(theirs.get(part))[:12]} in the "
                    f"swarm's spec); get the swarm's files"
                )
    if tokenizer_pin:
        mine_t = tokenizer_digest(tokenizer)
        if mine_t != tokenizer_pin:
            raise ConfigError(
                f"tokenizer: your {tokenizer} differs from the swarm's (tokenizer digest "
                f"{mine_t[:12]} here, {tokenizer_pin[:12]} in the swarm's spec); get the "
                f"swarm's tokenizer files"
            )
