"""The `meshtrain` command line's parser: its commands, and their flags — a swarm spec's generated
from the spec sections' fields (`swarm create`), a node's from `NodeConfig`'s (`node start`,
`swarm join`: `_config_flag`, one flag per field, its help the field's description, its default
the effective one), the demo's own. `node_config_of` turns parsed flags into the node config with
its other layers (node/spec/config.py).

Light by design: `node status` and `node stop` parse their flags here too, so this module imports
only the standard library at module level; the config model, pydantic and the spec sections are
imported inside the functions that build those flags (meshtrain/node/cli.py's docstring).

Not here: running the commands (meshtrain/node/cli.py).
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshtrain import __version__
from meshtrain.errors import ConfigError

if TYPE_CHECKING:
    from pydantic.fields import FieldInfo

    from meshtrain.node.spec.config import NodeConfig

STOP_WAIT_TIMEOUT = 120.0  # seconds `node stop --wait` waits for the node to exit


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is our one-line ConfigError (exit 2) like every other.

    `more_args(parser)` adds arguments the first time this parser parses: `swarm create` takes
    its flags from the pydantic spec model, `node start` and `swarm join` theirs from `NodeConfig`,
    models which other commands (`node status`, `node stop`) must not pay to import.
    """

    def __init__(
        self, *args: Any, more_args: Callable[[argparse.ArgumentParser], None] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._more_args = more_args

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
        if self._more_args is not None:
            more, self._more_args = self._more_args, None
            more(self)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{self.prog}: {message}")


def _node_flags(p: argparse.ArgumentParser) -> None:
    """The flags of `node start` and `swarm join`: `--config`, one flag per `NodeConfig` field
    (`_config_flag`; a field whose `json_schema_extra` says `flag: False` has none), `--quiet`.
    Every generated flag defaults to None, so a flag not given overrides no lower layer."""
    p.add_argument("--config", help="TOML file with node settings (see docs/configuration.md)")
    for name, info in _flagged_fields().items():
        _config_flag(p, name, info)
    p.add_argument(
        "--quiet",
        action="store_true",
        help="no live status line (on a terminal) or per-round lines (elsewhere) on stdout",
    )


def _spec_flags(p: argparse.ArgumentParser) -> None:
    from meshtrain.node.spec.swarm import FLAT_KEYS, default_of, field_of

    for name in FLAT_KEYS:  # the flat names: a flag per field of every section
        info = field_of(name)
        if name.endswith("_digest"):  # pinned by `swarm create` from the files, not typed
            continue
        if name == "allowlist":
            p.add_argument(
                "--allow",
                dest="spec_allowlist",
                action="append",
                default=None,
                help="allowlist admission: a peer id admitted from the start (repeatable; more at run "
                "time with `meshtrain swarm allow`)",
            )
            continue
        kind = {int: int, float: float}.get(info.annotation, str)  # type: ignore[arg-type]
        p.add_argument(
            f"--{name.replace('_', '-')}",
            dest=f"spec_{name}",
            type=kind,
            default=None,
            help=f"{info.description or name} (default {default_of(name)})",  # of a spec given no keys
        )


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="meshtrain", description="Train one PyTorch model together with strangers' machines, peer to peer."
    )
    p.add_argument("--version", action="version", version=f"meshtrain {__version__}")
    p.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (default; or MESHTRAIN_LOG)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    node = sub.add_parser("node", help="run and control a node")
    nsub = node.add_subparsers(dest="action", metavar="ACTION", parser_class=_Parser)
    nsub.add_parser("start", help="run a node in the foreground (Ctrl-C stops it cleanly)", more_args=_node_start_flags)
    for name, help_ in (
        ("status", "show the running node's status"),
        ("stop", "ask the running node to stop cleanly (returns once it accepted)"),
    ):
        q = nsub.add_parser(name, help=help_)
        q.add_argument(
            "--data-dir", help="the node's data dir (default $MESHTRAIN_DATA_DIR or ~/.local/share/meshtrain)"
        )
        q.add_argument("--url", help="the node's status URL instead of looking it up in the data dir")
        if name == "status":
            q.add_argument("--json", action="store_true", help="print the raw status document")
        else:
            q.add_argument(
                "--wait",
                action="store_true",
                help=f"wait until the node has left the swarm, checkpointed and exited "
                f"(at most {STOP_WAIT_TIMEOUT:.0f} s)",
            )

    swarm = sub.add_parser("swarm", help="create or join a swarm")
    ssub = swarm.add_subparsers(dest="action", metavar="ACTION", parser_class=_Parser)
    create = ssub.add_parser("create", help="write a swarm spec signed by this node's key", more_args=_spec_flags)
    create.add_argument("--data-dir", help="whose key signs (default ~/.local/share/meshtrain)")
    create.add_argument(
        "--out", help="where to write the spec (default: <data dir>/swarm.json; a directory: swarm.json in it)"
    )
    create.add_argument(
        "--private",
        action="store_true",
        help="a private swarm: admission private, and a new swarm key (written to <data dir>/swarm.key) "
        "that every peer must pass",
    )
    listing = ssub.add_parser("list", help="list the swarms the DHT's swarm index knows, as a table")
    listing.add_argument("--bootstrap", action="append", help="multiaddr of any meshtrain node (repeatable)")
    listing.add_argument("--config", help="TOML node config whose bootstrap list to use")
    listing.add_argument("--json", action="store_true", help="one JSON object per swarm instead of a table")
    join = ssub.add_parser(
        "join", help="join a swarm (by a peer's address, or by id or name via the DHT) and train", more_args=_node_flags
    )
    join.add_argument(
        "address",
        help="a peer's multiaddr, <swarm id>@<multiaddr>, or a swarm id or name from `meshtrain swarm list` "
        "(needs a bootstrap address)",
    )
    allow = ssub.add_parser("allow", help="on the owner's running node: admit a peer to an allowlist swarm")
    allow.add_argument("peer", help="the peer id to admit (a waiting node prints its own)")
    allow.add_argument("--revoke", action="store_true", help="take the peer's admission back")
    allow.add_argument(
        "--data-dir", help="the owner node's data dir (default $MESHTRAIN_DATA_DIR or ~/.local/share/meshtrain)"
    )
    allow.add_argument("--url", help="the owner node's status URL instead of looking it up in the data dir")

    sub.add_parser("demo", help="run a local swarm on this machine and show it training", more_args=_demo_flags)

    export = sub.add_parser(
        "export",
        help="write the swarm's outer parameters φ (latest checkpoint; a pipeline peer: every stage) as a model",
    )
    export.add_argument(
        "--data-dir", help="the node's data dir (default $MESHTRAIN_DATA_DIR or ~/.local/share/meshtrain)"
    )
    export.add_argument("--out", required=True, help="a new directory (HF save_pretrained layout for hf: models)")
    sample = sub.add_parser("sample", help="continue a prompt with the swarm's outer parameters φ")
    sample.add_argument(
        "--data-dir", help="the node's data dir (default $MESHTRAIN_DATA_DIR or ~/.local/share/meshtrain)"
    )
    sample.add_argument("--prompt", required=True, help="text to continue")
    sample.add_argument("--max-new-tokens", type=int, default=100, help="tokens to add (default 100)")
    sample.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (default 0: greedy)")
    sample.add_argument("--seed", type=int, default=0, help="seed of the top-k sampler (default 0)")
    return p


def _node_start_flags(p: argparse.ArgumentParser) -> None:
    """`node start`'s flags: the node's (`_node_flags`), and where its swarm spec comes from."""
    _node_flags(p)
    p.add_argument("--swarm", help="signed swarm spec file (default: the data dir's swarm.json)")
    p.add_argument("--join", help="peer multiaddr (or swarm-id@multiaddr) to fetch the swarm from")


def _flagged_fields() -> dict[str, FieldInfo]:
    """The `NodeConfig` fields that are flags, by name."""
    from meshtrain.node.spec.config import NodeConfig

    return {
        name: info
        for name, info in NodeConfig.model_fields.items()
        if not (isinstance(info.json_schema_extra, dict) and info.json_schema_extra.get("flag") is False)
    }


def _config_flag(p: argparse.ArgumentParser, name: str, info: FieldInfo) -> None:
    """`--<field-name>` for one `NodeConfig` field; its help is the field's description.

    A boolean that defaults to true is `--no-<name>` ("do not <description>": such a field is
    described by what it does), one that defaults to false a plain switch; a list is repeatable
    (`append`); a `Literal` gives the choices; int, float and Path are parsed as such, so a bad
    value is argparse's one-line error before any config is read."""
    flag = name.replace("_", "-")
    text = (info.description or name).replace("%", "%%")  # argparse formats help with %
    kind = info.annotation
    if typing.get_origin(kind) in (typing.Union, types.UnionType):  # `X | None`: None is the default
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    if kind is bool:
        if info.default is True:
            p.add_argument(f"--no-{flag}", dest=name, action="store_false", default=None, help=f"do not {text}")
        else:
            p.add_argument(f"--{flag}", dest=name, action="store_true", default=None, help=text)
        return
    default = info.get_default(call_default_factory=True)
    notes = []
    options: dict[str, Any] = {}
    if typing.get_origin(kind) is list:
        options["action"] = "append"
        kind = typing.get_args(kind)[0]
        notes.append("repeatable")
        default = ", ".join(default)
    if typing.get_origin(kind) is typing.Literal:
        options["choices"] = typing.get_args(kind)
    elif kind in (int, float, Path):
        options["type"] = kind
    elif kind is not str:
        raise TypeError(f"NodeConfig.{name}: no flag for a {kind} (mark the field flag: False, or parse it here)")
    if default not in (None, "") and not isinstance(default, Path):  # a path's default depends on the user
        notes.append(f"default {default:g}" if isinstance(default, float) else f"default {default}")
    more = f" ({'; '.join(notes)})" if notes else ""
    p.add_argument(f"--{flag}", dest=name, default=None, help=f"{text}{more}", **options)


def node_config_of(args: argparse.Namespace) -> NodeConfig:
    """The `NodeConfig` of `node start` / `swarm join`: `load_node_config`'s layers (defaults,
    node.toml, `--config`, the environment) under the flags given (`_node_flags`)."""
    from meshtrain.node.spec.config import load_node_config

    return load_node_config(args.config, overrides={name: getattr(args, name) for name in _flagged_fields()})


def _demo_flags(p: argparse.ArgumentParser) -> None:
    """`demo`'s flags; `--optimizer` and `--replica-sync` offer what the optimizer map and the spec
    model allow (node/demo.py `DEMO_OPTIMIZERS`), whose imports (torch, pydantic) only `demo` pays."""
    from meshtrain.node.demo import DEMO_OPTIMIZERS
    from meshtrain.pipeline.spec_section import PipelineSection

    p.add_argument("--nodes", type=int, default=None, help="number of node processes (default 4; --pipeline 6)")
    p.add_argument(
        "--optimizer", choices=DEMO_OPTIMIZERS, default="diloco", help="the outer optimizer (default diloco)"
    )
    p.add_argument("--steps", type=int, default=None, help="inner steps (default 600; --quick 60)")
    p.add_argument("--H", type=int, default=None, help="inner steps per round (default 50; --quick 20)")
    p.add_argument("--quick", action="store_true", help="a short run (CI)")
    p.add_argument("--out", default="runs/demo", help="where the plot and summary go (default runs/demo)")
    p.add_argument("--plain", action="store_true", help="plain progress lines instead of a live table")
    p.add_argument("--pipeline", action="store_true", help="a pipeline swarm: SkipPipe over --stages stages")
    p.add_argument("--stages", type=int, default=3, help="--pipeline: stages (default 3)")
    p.add_argument("--skip-ratio", type=float, default=0.0, help="--pipeline: SkipPipe's skip ratio (default 0)")
    p.add_argument(
        "--replica-sync",
        choices=typing.get_args(PipelineSection.model_fields["replica_sync"].annotation),
        default="every-step",
        help="--pipeline: how a stage's replicas agree (default every-step)",
    )
