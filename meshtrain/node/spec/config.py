"""How this node runs: `NodeConfig`, the one config model of a machine.

What a swarm trains is the other model, `SwarmSpec` (node/spec/swarm.py; signed in node/spec/signed.py): two
models because they have different owners. The spec is the swarm's contract, written once by its
creator, signed, identical on every peer; a node may not override it. The `NodeConfig` is this
machine's business: where to keep data, where to listen, whom to dial first, the status port, the device
it trains on (`device`, node/ranks/devices.py), how many local ranks make up the peer
(`nproc_per_node`, node/local_ranks.py) and how they split the model (`sharding`: DDP or FSDP2,
node/ranks/sharding.py).

Precedence for `NodeConfig`, lowest first: defaults, the shipped defaults file (`node.toml`
beside this module: the default bootstrap list, shipped empty), the TOML file (`--config
node.toml`, a `[node]` table or top-level keys), `MESHTRAIN_<FIELD>` environment variables (lists
comma-separated), then command-line flags. Every value is validated by pydantic; a bad one is a
`ConfigError` naming the field, the value and what is allowed — one line, never a traceback.

The flags are generated from the fields (node/cli.py `_node_flags`): `--<field-name>`, its help the
field's `description` and default, so a field's description is what `meshtrain node start --help`
and docs/configuration.md (node/spec/reference.py) say of it. A boolean field that defaults to true
is the flag `--no-<field-name>`, whose help reads "do not <description>": describe such a field by
what it does ("relay for private peers ..."). A field marked `json_schema_extra={"flag": False}`
has no flag of its own (`log_level`: the global `meshtrain --log-level`; `pipeline_lab`: lab only).
"""

from __future__ import annotations

import os
import reprlib
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypedDict

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from meshtrain.errors import ConfigError

ENV_PREFIX = "MESHTRAIN_"
DEFAULT_CONFIG_FILE = Path(__file__).with_name("node.toml")  # shipped defaults (the bootstrap list)


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "meshtrain"


class RelayQuota(TypedDict):
    """What a relay gives others (transport/relay.py `RelayConfig`'s fields of the same names)."""

    max_reservations: int
    circuit_bytes: int


class NodeConfig(BaseModel):
    """How this node runs. See `meshtrain node start --help` and docs/configuration.md."""

    model_config = ConfigDict(extra="forbid")

    data_dir: Path = Field(
        default_factory=default_data_dir,
        description="the node's identity key, signed swarm spec, checkpoints and other files; default "
        "$XDG_DATA_HOME/meshtrain, else ~/.local/share/meshtrain",
    )
    name: str = Field("", max_length=64, description="a label shown on the status page")
    listen: list[str] = Field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/4001"], description="multiaddrs to listen on")
    announce: list[str] = Field(
        default_factory=list,
        description="multiaddrs to advertise instead of the listen addresses (a public address behind port forwarding)",
    )
    data_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="TCP port of the tensor data plane, where bulk tensors go direct; 0 = any free port. Behind a "
        "firewall or a port forward, open it beside the libp2p port (the same number outside as inside)",
    )
    bootstrap: list[str] = Field(
        default_factory=list,
        description="peers to dial at start; any meshtrain node is an entry to the DHT that lists swarms "
        "(shipped empty in meshtrain/node/spec/node.toml: we ship no addresses we cannot vouch for)",
    )
    swarm_key: str | None = Field(
        None,
        description="64 hex chars: a private swarm's key (libp2p pnet; `swarm create --private` makes one); "
        "prefer the environment variable MESHTRAIN_SWARM_KEY to the flag, which `ps` shows",
    )
    status_host: str = Field(
        "127.0.0.1",
        description="address of the local status page (dashboard, /status JSON, Prometheus /metrics); to see "
        "a remote node's, tunnel it (ssh -L) rather than bind it to a public address",
    )
    status_port: int = Field(
        7070, ge=0, le=65535, description="port of the status page; 0 = any free port (written to daemon.json)"
    )
    tensorboard: Path | None = Field(
        None,
        description="also write the training's scalars (loss, held-out loss, rounds, bytes) as TensorBoard "
        "event files into this directory (needs the tensorboardX package)",
    )
    checkpoint_every: float = Field(
        60.0, gt=0, description="seconds between background checkpoints (one is also written at shutdown)"
    )
    keep_checkpoints: int = Field(3, ge=1, le=100, description="checkpoints kept in the data dir")
    threads: int = Field(0, ge=0, le=1024, description="torch threads; 0 = torch's default")
    join_timeout: float = Field(30.0, gt=0, description="seconds a round waits for its peers")
    part_timeout: float = Field(
        20.0, gt=0, description="seconds one all-reduce transfer may take (larger transfers get more in proportion)"
    )
    wait_peers: int = Field(0, ge=0, le=10_000, description="start training once this many peers are in")
    wait_peers_timeout: float = Field(
        120.0, gt=0, description="seconds to wait for wait_peers before training with those there are"
    )
    max_peers: int = Field(
        32,
        ge=2,
        le=10_000,
        description="connections to other peers this node keeps: the whole swarm up to this many, above it "
        "its round's group partners (never cut), the next round's, DHT neighbours and a gossip sample",
    )
    max_donors: int = Field(0, ge=0, le=1000, description="late join: download from at most this many peers (0 = all)")
    donor_upload_mib: float = Field(0.0, ge=0, description="cap on serving state to joiners, MiB/s (0 = none)")
    uplink_mbit: float = Field(
        0.0,
        ge=0,
        le=8e6,
        description="our uplink, Mbit/s: sizes our part of each all-reduce (bandwidth-weighted parts) and how "
        "many of our stripes are in flight; 0 = measured",
    )
    max_steps: int | None = Field(None, ge=0, description="stop after this step (below the swarm's)")
    pipeline_lab: Path | None = Field(
        None,
        description="lab only: a JSON file of simulated links and compute for a pipeline swarm on one "
        "machine (node/stages/lab.py; scripts/bench/bench_pipeline_swarm.py)",
        json_schema_extra={"flag": False},  # the benchmark sets it; users' --help does without it
    )
    nat: bool = Field(
        True,
        description="traverse NATs: dial-back reachability probe, relay reservations "
        "when private, hole punching of relayed peers",
    )
    relay: bool = Field(True, description="relay for private peers once a dial-back shows we are public")
    # The relay's quota for what it gives others (transport/relay.py `RelayConfig`; the defaults
    # are its own, sized for training through a relay: tests/test_node_config.py keeps them equal).
    relay_reservations: int = Field(
        128, ge=1, le=4096, description="as a relay: private peers that may hold a reservation on us at once"
    )
    relay_circuit_mib: int = Field(
        16384,
        ge=0,
        description="as a relay: MiB one relayed connection may carry, both directions together, before it is "
        "reset (0: unlimited; the peers reconnect for more)",
    )
    mdns: bool = Field(
        False,
        description="find peers of this swarm on the LAN over mDNS (multicast): no bootstrap needed between "
        "machines on one LAN",
    )
    upnp: bool = Field(
        True, description="map our ports on the LAN's UPnP gateway (only when listening beyond loopback)"
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "WARNING",
        description="how much the node logs (ours; MESHTRAIN_LOG_LIBP2P=1 also shows py-libp2p's at DEBUG)",
        json_schema_extra={"flag": False},  # `meshtrain --log-level`, before the command, sets it
    )
    device: str = Field(
        "auto",
        description="auto (CUDA, then Apple's MPS, then CPU), cpu, mps, cuda or cuda:<index>; a device this "
        "machine lacks is a one-line error naming what it has",
    )
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
        from meshtrain.node.ranks.devices import check_device_name

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

    def relay_limits(self) -> RelayQuota:
        """The relay quota as transport/relay.py `RelayConfig`'s keyword arguments."""
        return {"max_reservations": self.relay_reservations, "circuit_bytes": self.relay_circuit_mib << 20}


# A bad value as an error shows it: bounded, so that hostile input (a list nested 5000 deep, a
# megabyte string, from the network) is neither a RecursionError nor a megabyte of message.
_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = 200
_SHOWN.maxlevel = 3


def one_line_error(e: ValidationError, what: str, *, shown_as: Mapping[str, str] | None = None) -> ConfigError:
    """A pydantic validation error as the one-line ConfigError the CLI prints; `shown_as` names a
    field (its dotted path) as the user wrote it (a swarm spec's flat keys, node/spec/swarm.py)."""
    err = e.errors()[0]
    field = ".".join(str(p) for p in err["loc"]) or what
    field = (shown_as or {}).get(field, field)
    msg = err["msg"].removeprefix("Value error, ")
    value = err.get("input")
    shown = "" if isinstance(value, dict) else f" (got {_SHOWN.repr(value)})"
    more = f"; and {len(e.errors()) - 1} more problem(s)" if len(e.errors()) > 1 else ""
    return ConfigError(f"{what}: {field}: {msg}{shown}{more}")


def _env_values(environ: Mapping[str, str]) -> dict[str, Any]:
    # MESHTRAIN_LOG sets every command's level (log.py `configure`), the node's too; the field's
    # own MESHTRAIN_LOG_LEVEL, read below, overrides it.
    out: dict[str, Any] = {"log_level": environ["MESHTRAIN_LOG"]} if environ.get("MESHTRAIN_LOG") else {}
    for name, info in NodeConfig.model_fields.items():
        raw = environ.get(ENV_PREFIX + name.upper())
        if raw is None:
            continue
        is_list = "list" in str(info.annotation)
        out[name] = [x.strip() for x in raw.split(",") if x.strip()] if is_list else raw
    return out


def _read_toml(p: Path) -> dict[str, Any]:
    """A config file's settings: its `[node]` table, or its top-level keys."""
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {p} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file {p}: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {p} is not valid TOML: {e}") from None
    return data.get("node", data) if isinstance(data.get("node"), dict) else data


def load_node_config(
    path: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> NodeConfig:
    """Defaults < the shipped defaults file (`node.toml` beside this module: the default
    bootstrap list) < TOML file < MESHTRAIN_* environment < `overrides` (flags; None ignored)."""
    values: dict[str, Any] = _read_toml(DEFAULT_CONFIG_FILE) if DEFAULT_CONFIG_FILE.exists() else {}
    if path is not None:
        values.update(_read_toml(Path(path)))
    values.update(_env_values(os.environ if environ is None else environ))
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        return NodeConfig.model_validate(values)
    except ValidationError as e:
        raise one_line_error(e, "node config") from None
