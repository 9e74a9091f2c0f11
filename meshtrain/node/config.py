"""The one config model: what a swarm trains (`SwarmSpec`) and how this node runs (`NodeConfig`).

Two models because they have different owners. The `SwarmSpec` is the swarm's contract — model,
tokenizer, data, optimizer, hyper-parameters, and the digests of the model's and tokenizer's files
(pinned when it is signed, models/sources.py) — written once by the swarm's creator, signed, and
identical on every peer (`swarm_spec.py`); a node may not override it. The `NodeConfig` is this machine's
business: where to keep data, where to listen, whom to dial first, the status port, the device
it trains on (`device`, node/devices.py), how many local ranks make up the peer
(`nproc_per_node`, node/local_ranks.py) and how they split the model (`sharding`: DDP or FSDP2,
node/sharding.py). The spec's `precision` is the swarm's: peers that train in
different precisions are different experiments.

Precedence for `NodeConfig`, lowest first: defaults, the TOML file (`--config node.toml`, a
`[node]` table or top-level keys), `MESHTRAIN_<FIELD>` environment variables (lists
comma-separated), then command-line flags. Every value is validated by pydantic; a bad one is a
`ConfigError` naming the field, the value and what is allowed — one line, never a traceback.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from meshtrain.collective.compression import CODECS
from meshtrain.errors import ConfigError
from meshtrain.models.sources import parse_model_source
from meshtrain.models.tokenizers import check_tokenizer_name
from meshtrain.pyref import PyRef

ENV_PREFIX = "MESHTRAIN_"
OPTIMIZERS = ("diloco", "streaming", "noloco", "sparseloco")  # built in; or py:<module>:<Class>
# Defaults that differ for one optimizer (its class's defaults): a spec that names that optimizer and
# not the key gets this value written in. The field defaults stay, so other optimizers' specs — and
# their swarm ids — are unchanged. SparseLoCo: outer lr 1.0 (not 0.7), β 0.9 (the sweep in
# optim/sparseloco.py's docstring; the field keeps 0.95, which no other optimizer reads).
OPTIMIZER_DEFAULTS: dict[str, dict[str, float]] = {"sparseloco": {"outer_lr": 1.0, "error_decay": 0.9}}


class SwarmSpec(BaseModel):
    """What the swarm trains. Every peer runs exactly this (the spec's digest is part of the
    swarm id, so two different specs are two different swarms)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field("meshtrain-demo", min_length=1, max_length=64)
    model: str = Field(
        "gpt-small",
        description="gpt-tiny | gpt-small | gpt-large | hf:<pretrained dir> | "
        "hf-config:<config.json> | py:<module or file.py>:<factory> | user",
    )
    tokenizer: str = Field(
        "chars",
        description="chars | bytes | hf:<dir or tokenizer.json> (default: chars for "
        "the builtin text, bytes for a file dataset)",
    )
    context: int = Field(0, ge=0, le=1 << 20, description="tokens per training sequence; 0 = the model's own")
    model_digest: str = Field("", max_length=256, description="pinned at swarm create (models/sources.py)")
    tokenizer_digest: str = Field("", max_length=64, description="pinned at swarm create (models/tokenizers.py)")
    dataset: str = Field(
        "builtin",
        description="builtin (offline English text), or a text, JSONL or Parquet file or directory (meshtrain.data)",
    )
    dataset_field: str = Field(
        "text", min_length=1, max_length=256, description="JSONL/Parquet: the field that holds a document's text"
    )
    held_out: float = Field(
        0.05, gt=0, lt=1, description="fraction of a file dataset's documents held out for evaluation (chosen by hash)"
    )
    eval_dataset: str = Field("", description="held-out data as its own file or directory (instead of held_out)")
    dataset_digest: str = Field(
        "",
        pattern=r"^([0-9a-f]{64})?$",
        description="content digest of the dataset's files (swarm create "
        "computes it; peers whose files differ are refused)",
    )
    optimizer: str = Field(
        "diloco",
        description="diloco | streaming | noloco | sparseloco | py:<module or file.py>:<OuterOptimizer subclass>",
    )
    optimizer_digest: str = Field("", max_length=64, description="pinned at swarm create for a py: optimizer")
    H: int = Field(50, ge=1, le=100_000, description="inner steps per outer round")
    steps: int = Field(2000, ge=0, description="inner steps to train; 0 = until stopped")
    batch_size: int = Field(16, ge=1, le=4096)
    inner_lr: float = Field(2e-3, gt=0, le=1)
    weight_decay: float = Field(0.01, ge=0, le=1)
    clip: float = Field(1.0, gt=0)
    outer_lr: float = Field(0.7, gt=0, le=10, description="outer learning rate (sparseloco: 1.0 unless given)")
    outer_momentum: float = Field(0.9, ge=0, lt=1)
    codec: str = "none"
    fragments: int = Field(2, ge=1, le=64, description="Streaming DiLoCo: P")
    delay: int = Field(1, ge=0, description="Streaming DiLoCo: τ")
    alpha: float = Field(0.5, ge=0, le=1, description="Streaming DiLoCo: merge weight")
    eager: bool = Field(False, description="Streaming DiLoCo: eager updates (arXiv 2502.12996)")
    error_decay: float = Field(
        0.95, ge=0, le=1, description="SparseLoCo: β, the error-feedback decay (sparseloco: 0.9 unless given)"
    )
    sparse_k: int = Field(64, ge=1, description="SparseLoCo: values kept per chunk")
    sparse_chunk: int = Field(4096, ge=1, le=1 << 20, description="SparseLoCo: values per chunk")
    seed: int = Field(0, ge=0, lt=2**31)
    eval_every: int = Field(50, ge=0, description="held-out evaluation every this many steps")
    eval_batches: int = Field(8, ge=1, le=1024)
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32",
        description="forward pass under autocast: fp32 | bf16 | fp16 (fp16 adds loss scaling); "
        "master weights, φ and pseudo-gradients stay fp32",
    )

    @model_validator(mode="before")
    @classmethod
    def _tokenizer_for_the_data(cls, data: Any) -> Any:
        """A file dataset is streamed, and chars needs the whole text for its alphabet: unless a
        tokenizer is named, a file dataset is tokenised as bytes; chars for one is an error."""
        if isinstance(data, dict) and data.get("dataset", "builtin") != "builtin":
            if data.get("tokenizer") is None:
                data = {**data, "tokenizer": "bytes"}
            elif data["tokenizer"] == "chars":
                raise ValueError(
                    "tokenizer chars needs the whole text for its alphabet; a file dataset is "
                    "streamed: use bytes or hf:<dir>"
                )
        return data

    @model_validator(mode="before")
    @classmethod
    def _defaults_of_the_optimizer(cls, data: Any) -> Any:
        """An optimizer's own defaults (OPTIMIZER_DEFAULTS) for the keys the spec does not give."""
        if isinstance(data, dict) and data.get("optimizer") in OPTIMIZER_DEFAULTS:
            own = OPTIMIZER_DEFAULTS[data["optimizer"]]
            data = {**data, **{k: v for k, v in own.items() if data.get(k) is None}}
        return data

    @field_validator("model")
    @classmethod
    def _model(cls, v: str) -> str:
        parse_model_source(v)
        return v

    @field_validator("optimizer")
    @classmethod
    def _optimizer(cls, v: str) -> str:
        if v not in OPTIMIZERS:
            try:
                PyRef.parse(v)
            except ValueError:
                raise ValueError(
                    f"must be one of {', '.join(OPTIMIZERS)} or py:<module or file.py>:<Class>, "
                    f"a meshtrain.OuterOptimizer subclass"
                ) from None
        return v

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer(cls, v: str) -> str:
        return check_tokenizer_name(v)

    @field_validator("codec")
    @classmethod
    def _codec(cls, v: str) -> str:
        if v not in CODECS:
            raise ValueError(f"must be one of {', '.join(sorted(CODECS))}")
        return v

    def check(self) -> SwarmSpec:
        """Cross-field rules the optimizers would otherwise reject at start-up."""
        if self.optimizer == "streaming":
            if self.H % self.fragments:
                raise ConfigError(f"swarm spec: H ({self.H}) must be a multiple of fragments ({self.fragments})")
            if self.delay >= self.H // self.fragments:
                raise ConfigError(
                    f"swarm spec: delay ({self.delay}) must be below H/fragments ({self.H // self.fragments})"
                )
            if self.eager and self.delay < 1:
                raise ConfigError("swarm spec: eager updates need delay >= 1")
        if self.model.startswith("hf:") and not self.tokenizer.startswith("hf:"):
            raise ConfigError(
                f"swarm spec: the pretrained model {self.model} needs the tokenizer it was trained "
                f"with (--tokenizer {self.model}), not {self.tokenizer}"
            )
        if self.optimizer == "sparseloco" and self.sparse_k > self.sparse_chunk:
            raise ConfigError(
                f"swarm spec: sparse_k ({self.sparse_k}) must be at most sparse_chunk ({self.sparse_chunk})"
            )
        return self


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "meshtrain"


class NodeConfig(BaseModel):
    """How this node runs. See `meshtrain node start --help` and README, "Configuration"."""

    model_config = ConfigDict(extra="forbid")

    data_dir: Path = Field(default_factory=default_data_dir)
    name: str = Field("", max_length=64)
    listen: list[str] = Field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/4001"])
    announce: list[str] = Field(default_factory=list)
    bootstrap: list[str] = Field(default_factory=list)
    swarm_key: str | None = Field(None, description="64 hex chars: a private swarm")
    status_host: str = "127.0.0.1"
    status_port: int = Field(7070, ge=0, le=65535, description="0 = any free port")
    checkpoint_every: float = Field(60.0, gt=0, description="seconds between checkpoints")
    keep_checkpoints: int = Field(3, ge=1, le=100)
    threads: int = Field(0, ge=0, le=1024, description="torch threads; 0 = torch's default")
    join_timeout: float = Field(30.0, gt=0, description="seconds a round waits for its peers")
    part_timeout: float = Field(20.0, gt=0)
    wait_peers: int = Field(0, ge=0, le=10_000, description="start training once this many peers are in")
    wait_peers_timeout: float = Field(120.0, gt=0)
    max_donors: int = Field(0, ge=0, le=1000, description="late join: download from at most this many peers (0 = all)")
    donor_upload_mib: float = Field(0.0, ge=0, description="cap on serving state to joiners, MiB/s (0 = none)")
    max_steps: int | None = Field(None, ge=0, description="stop after this step (below the swarm's)")
    nat: bool = Field(
        True,
        description="NAT traversal: dial-back reachability probe, relay reservations "
        "when private, hole punching of relayed peers",
    )
    relay: bool = Field(True, description="relay for private peers once a dial-back shows we are public")
    mdns: bool = Field(False, description="find peers of this swarm on the LAN over mDNS (multicast)")
    upnp: bool = Field(
        True, description="map our ports on the LAN's UPnP gateway (only when listening beyond loopback)"
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "WARNING"
    device: str = Field("auto", description="auto (CUDA, then MPS, then CPU), cpu, mps, cuda or cuda:<index>")
    nproc_per_node: int = Field(
        1,
        ge=1,
        le=64,
        description="local ranks (GPUs) that train as one peer "
        "(torch.distributed; the spec's batch_size is split among them)",
    )
    sharding: Literal["ddp", "fsdp", "auto"] = Field(
        "auto",
        description="how local ranks split the model: ddp (a replica per rank), fsdp (FSDP2 shards), "
        "auto (fsdp when the model's training state exceeds half a GPU; ddp on CPU)",
    )

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        from meshtrain.node.devices import check_device_name

        return check_device_name(v)

    @field_validator("listen", "announce", "bootstrap")
    @classmethod
    def _addrs(cls, v: list[str]) -> list[str]:
        from meshtrain.transport.host import parse_multiaddr

        for a in v:
            try:
                parse_multiaddr(a)
            except Exception as e:  # noqa: BLE001 — multiaddr raises many types; we say which address
                raise ValueError(f"{a!r} is not a multiaddr ({e})") from None
        return v

    @field_validator("swarm_key")
    @classmethod
    def _key(cls, v: str | None) -> str | None:
        if v is not None and (len(v) != 64 or any(c not in "0123456789abcdefABCDEF" for c in v)):
            raise ValueError("must be 64 hexadecimal characters")
        return v

    @field_validator("log_level", mode="before")
    @classmethod
    def _level(cls, v: Any) -> Any:
        return v.upper() if isinstance(v, str) else v


def _one_line(e: ValidationError, what: str) -> ConfigError:
    err = e.errors()[0]
    field = ".".join(str(p) for p in err["loc"]) or what
    msg = err["msg"].removeprefix("Value error, ")
    value = err.get("input")
    shown = "" if isinstance(value, dict) else f" (got {value!r})"
    more = f"; and {len(e.errors()) - 1} more problem(s)" if len(e.errors()) > 1 else ""
    return ConfigError(f"{what}: {field}: {msg}{shown}{more}")


def parse_spec(data: Mapping[str, Any]) -> SwarmSpec:
    try:
        return SwarmSpec.model_validate(dict(data)).check()
    except ValidationError as e:
        raise _one_line(e, "swarm spec") from None


def _env_values(environ: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, info in NodeConfig.model_fields.items():
        raw = environ.get(ENV_PREFIX + name.upper())
        if raw is None:
            continue
        is_list = "list" in str(info.annotation)
        out[name] = [x.strip() for x in raw.split(",") if x.strip()] if is_list else raw
    return out


def load_node_config(
    path: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> NodeConfig:
    """Defaults < TOML file < MESHTRAIN_* environment < `overrides` (flags; None values ignored)."""
    values: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {p} does not exist") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read config file {p}: {e}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p} is not valid TOML: {e}") from None
        values.update(data.get("node", data) if isinstance(data.get("node"), dict) else data)
    values.update(_env_values(os.environ if environ is None else environ))
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        return NodeConfig.model_validate(values)
    except ValidationError as e:
        raise _one_line(e, "node config") from None
