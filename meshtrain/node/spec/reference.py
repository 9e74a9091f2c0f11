"""The configuration reference, rendered from the models: `docs/configuration.md`.

Every key a user can set lives in one of two pydantic models — `NodeConfig` (config.py: how this
machine runs) and `SwarmSpec` (swarm.py: what the swarm trains, in sections each owned by its
layer, meshtrain/spec_section.py) — with its help text in the field's `description`, its default
and its bounds. `swarm create` builds its flags from the same fields (node/cli.py), one per flat
key (swarm.py `FLAT_KEYS`); the page shows each spec key where a spec file holds it
(`outer.H`) with the flag that sets it (`--H`) and, like the flag's help, the default a spec
given no keys has (swarm.py `default_of`: an open swarm's aggregation is trimmed_mean). A hand-kept reference drifted from them; this one is rendered from them, so
it cannot: `render()` returns the page, and tests/test_docs.py fails when the committed page
differs from it.

    python -m meshtrain.node.spec.reference            # rewrite docs/configuration.md
    python -m meshtrain.node.spec.reference --check    # exit 1 if it is out of date

What each key means is the field's help text; to change the page, change the model and run the
command above. The flags are read from the command line's own parser, so a key shows the flag
that really sets it (or none).

Not here: the help texts themselves (config.py, swarm.py and the sections); the precedence of config layers
(config.py `load_node_config`).
"""

from __future__ import annotations

import argparse
import sys
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import annotated_types
from pydantic.fields import FieldInfo

from meshtrain.node.spec.config import DEFAULT_CONFIG_FILE, ENV_PREFIX, NodeConfig
from meshtrain.node.spec.swarm import FLAT_KEYS, SECTIONS, SwarmSpec, default_of, field_of
from meshtrain.optim import BUILTIN_OPTIMIZERS

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_OUT = REPO_ROOT / "docs" / "configuration.md"
COMMAND = "python -m meshtrain.node.spec.reference"

_NODE_INTRO = f"""\
How this machine runs a node: where it keeps its data, where it listens, whom it dials first, its
status page, the device it trains on. Every peer chooses its own; none of it is part of the swarm.

`meshtrain node start` and `meshtrain swarm join` read, lowest precedence first: the defaults
below, the shipped defaults file `meshtrain/node/spec/{DEFAULT_CONFIG_FILE.name}` (the bootstrap list, shipped empty),
`--config node.toml` (a `[node]` table or top-level keys), `{ENV_PREFIX}<KEY>` environment variables
(the key in capitals; lists comma-separated), then flags. A bad value is one line naming the key,
and exit code 2. From Python: `meshtrain.NodeConfig(...)`, or
`meshtrain.node.spec.config.load_node_config(path)` for the same layers.
"""

_SPEC_INTRO = """\
What the swarm trains: written once by its creator (`meshtrain swarm create --<flag> <value>`, or
`meshtrain.SwarmSpec(...)`), signed, identical on every peer. The spec's digest is part of the swarm
id, so two different specs are two different swarms, and no node may override a key. A spec
file (`swarm.json`, format `meshtrain.swarm/2`) holds the spec in sections, as below (`outer.H`).
Each key also has a flat name, its flag without the dashes (`H`, `aggregation_trim`): the name
`meshtrain.SwarmSpec(H=10)` and `parse_spec({"H": 10})` take, and the key of a spec file written
before the sections (`meshtrain.swarm/1`), which still verifies and keeps its id. So does a spec
signed by an older meshtrain without keys added since (the missing keys take their defaults).
`swarm create --private` sets `admission.mode = "private"` and writes a new swarm key. The
`*digest` keys are pinned by `swarm create` from the files, never typed.
"""


def render() -> str:
    """The whole reference page, as docs/configuration.md holds it."""
    parser = _command_line()
    top_level = {dest: [f"meshtrain {o}" for o in opts] for dest, opts in _flags(parser).items()}
    node_flags = {**top_level, **_flags(parser, "node", "start")}
    spec_flags = {dest.removeprefix("spec_"): opts for dest, opts in _flags(parser, "swarm", "create").items()}
    lines = [
        "# Configuration reference",
        "",
        f"<!-- Generated from NodeConfig and SwarmSpec by `{COMMAND}`; do not edit by hand:",
        "     change a field's description in meshtrain/node/spec/config.py, swarm.py or a spec section",
        "     (the file each section names below) and rerun it.",
        "     tests/test_docs.py fails when this page is out of date. -->",
        "",
        "Every key a node or a swarm can be given, with its default and what it does. How to use them:",
        "[guide.md](guide.md); how the parts they tune work: [architecture.md](architecture.md).",
        "",
        "## Node config (`NodeConfig`)",
        "",
        _NODE_INTRO,
        "| key | default | flag, environment | meaning |",
        "|---|---|---|---|",
    ]
    for name, info in NodeConfig.model_fields.items():
        flag = _flag_cell(node_flags.get(name))
        env = f"`{ENV_PREFIX}{name.upper()}`"
        lines.append(_row(name, _default(info), f"{flag}, {env}" if flag else env, _meaning(info)))
    lines += [
        "",
        "## Swarm spec (`SwarmSpec`)",
        "",
        _SPEC_INTRO,
        "Defaults that depend on the optimizer (a spec that names it and not the key gets this value):",
        "",
    ]
    for optimizer, cls in BUILTIN_OPTIMIZERS.items():
        keys = cls.spec_defaults
        if not keys:
            continue
        given = ", ".join(f"`{k} = {v:g}`" if isinstance(v, float) else f"`{k} = {v}`" for k, v in keys.items())
        lines.append(f"- `{optimizer}`: {given}")
    flat_of = {where: key for key, where in FLAT_KEYS.items()}
    lines += ["", "| key | default | flag | meaning |", "|---|---|---|---|"]
    for name in SwarmSpec.model_fields:
        if name not in SECTIONS:
            lines.append(
                _row(name, _value(default_of(name)), _flag_cell(spec_flags.get(name)), _meaning(field_of(name)))
            )
    for name, section in SECTIONS.items():
        lines += [
            "",
            f"### `{name}`: {SwarmSpec.model_fields[name].description}",
            "",
            f"`{section.__name__}`, {section.__module__.replace('.', '/')}.py.",
            "",
            "| key | default | flag | meaning |",
            "|---|---|---|---|",
        ]
        for field in section.model_fields:
            key = flat_of[(name, field)]
            info = field_of(key)
            lines.append(
                _row(f"{name}.{field}", _value(default_of(key)), _flag_cell(spec_flags.get(key)), _meaning(info))
            )
    return "\n".join(lines) + "\n"


def _command_line() -> argparse.ArgumentParser:
    from meshtrain.node.cli import build_parser

    return build_parser()


def _flags(parser: argparse.ArgumentParser, *path: str) -> dict[str, list[str]]:
    """dest -> option strings of the (sub)parser at `path`. argparse has no public walk over
    subcommands, so this reads `_actions`, and triggers the lazily added flags of `swarm create`
    (node/cli.py `_Parser`) by parsing nothing."""
    for name in path:
        parser = next(a.choices[name] for a in parser._actions if isinstance(a.choices, dict) and name in a.choices)
    parser.parse_known_args([])
    return {a.dest: list(a.option_strings) for a in parser._actions if a.option_strings and a.dest != "help"}


def _flag_cell(options: list[str] | None) -> str:
    return ", ".join(f"`{o}`" for o in options) if options else ""


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
        return "see meaning" if isinstance(value, Path) else _value(value)
    return _value(info.default)


def _value(value: Any) -> str:
    if value is None or value == "" or value == () or value == []:
        return "none"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float):
        return f"`{value:g}`"
    if isinstance(value, list | tuple):
        return ", ".join(f"`{v}`" for v in value)
    return f"`{value}`"


def _meaning(info: FieldInfo) -> str:
    text = (info.description or "").strip()
    allowed = list(_allowed(info))
    if allowed:
        text = f"{text}{'. ' if text else ''}Allowed: {', '.join(allowed)}."
    return text


def _allowed(info: FieldInfo) -> Iterator[str]:
    if typing.get_origin(info.annotation) is typing.Literal:
        yield "one of " + ", ".join(f"`{c}`" for c in typing.get_args(info.annotation))
    for m in info.metadata:
        for attr, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            bound = getattr(m, attr, None)
            if isinstance(m, annotated_types.BaseMetadata) and isinstance(bound, int | float):
                yield f"{sign} {bound:g}" if isinstance(bound, float) else f"{sign} {bound}"
        if isinstance(m, annotated_types.MaxLen):
            yield f"at most {m.max_length} {'characters' if info.annotation is str else 'items'}"


def _row(name: str, default: str, flag: str, meaning: str) -> str:
    return "| " + " | ".join(_cell(c) for c in (f"`{name}`", default, flag, meaning)) + " |"


def _cell(text: str) -> str:
    """Markdown-safe table cell: `|` escaped everywhere; outside code spans also `<`, `>` (GitHub
    would take `<dir>` for an HTML tag and drop it) and `*` (emphasis)."""
    parts = text.split("`")
    for i, part in enumerate(parts):
        part = part.replace("|", "\\|")
        if i % 2 == 0:
            part = part.replace("<", "&lt;").replace(">", "&gt;").replace("*", "\\*")
        parts[i] = part
    return "`".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=COMMAND, description="Render docs/configuration.md from the models.")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"where the page goes (default {DEFAULT_OUT})")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if --out is out of date")
    args = ap.parse_args(argv)
    page = render()
    current = args.out.read_text() if args.out.exists() else None
    if args.check:
        if current != page:
            print(f"{args.out} is out of date: run {COMMAND}", file=sys.stderr)
            return 1
        return 0
    if current != page:
        args.out.write_text(page)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
