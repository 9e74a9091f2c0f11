"""The README's and docs' code blocks are held to the code: every `meshtrain ...` line of a shell
block parses with the real CLI parser, every `swarm create` that needs no file of the reader's is
run for real, every `make` target exists, every Python block compiles and its imports and
`meshtrain.X` names resolve, and the Python blocks that are whole programs (they end in
`trio.run`) run. Placeholders a reader fills in (`<multiaddr>`, a trailing `...`, `[optional
flags]`) are filled in or dropped before parsing; lines that need a second machine are parsed,
not run.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import meshtrain
from meshtrain.errors import MeshtrainError
from meshtrain.node.cli import build_parser, main

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
ADDRESS = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWQ1kE7bJ8fB6h3c9Y2JcNqkz9V4x4sN2wYt5u9ZrGm1aB"


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    source: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(*langs: str) -> list[Block]:
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
            if m.group(1) in langs:
                line = text[: m.start()].count("\n") + 1
                out.append(Block(str(page.relative_to(ROOT)), line, m.group(1), m.group(2)))
    return out


def shell_commands(block: Block) -> list[list[str]]:
    """The block's commands as argv lists: continuation lines joined, comments dropped, the
    reader's placeholders filled in."""
    joined = block.source.replace("\\\n", " ")
    commands = []
    for raw in joined.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", raw).strip()
        if not line:
            continue
        line = re.sub(r"\[[^\]]*\]", "", line)  # optional flags shown in brackets
        line = line.replace("<multiaddr>", ADDRESS).replace("<address>", ADDRESS)
        line = re.sub(r"/p2p/12D3Koo\w*\.\.\.", "/p2p/" + ADDRESS.rsplit("/", 1)[1], line)
        line = re.sub(r"\bms\w*\.\.\.@", "", line)
        argv = [a for a in shlex.split(line) if a != "..."]
        commands.append(argv)
    return commands


SHELL = [b for b in blocks("sh", "bash")]
PYTHON = [b for b in blocks("python")]


def test_the_pages_have_blocks_to_check():
    assert len(SHELL) >= 15 and len(PYTHON) >= 6


def runnable_create(argv: list[str]) -> bool:
    """A `swarm create` that needs none of the reader's files or models."""
    text = " ".join(argv)
    return argv[1:3] == ["swarm", "create"] and not re.search(r"hf:|py:|--dataset|--eval-dataset", text)


@pytest.mark.parametrize("block", SHELL, ids=str)
def test_every_shell_line_parses_and_every_self_contained_swarm_create_runs(block, tmp_path):
    parser = build_parser()
    for n, argv in enumerate(shell_commands(block)):
        if argv[0] == "make":
            targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M)
            assert all(t in targets for t in argv[1:]), (str(block), argv)
            continue
        if argv[0] != "meshtrain":
            continue
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                parser.parse_args(argv[1:])
        except (SystemExit, MeshtrainError) as e:
            pytest.fail(f"{block}: `{' '.join(argv)}` does not parse: {e}")
        if runnable_create(argv):
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main([*argv[1:], "--data-dir", str(tmp_path / str(n))])
            assert code == 0, f"{block}: `{' '.join(argv)}` failed: {err.getvalue()}"


def names_used(tree: ast.AST) -> tuple[list[tuple[str, str]], set[str]]:
    """(module, name) of every `from meshtrain... import name`, and every `meshtrain.X` read."""
    imports, attributes = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("meshtrain"):
            imports += [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            imports += [(a.name, "") for a in node.names if a.name.startswith("meshtrain")]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "meshtrain":
            attributes.add(node.attr)
    return imports, attributes


@pytest.mark.parametrize("block", PYTHON, ids=str)
def test_every_python_block_compiles_and_names_what_exists(block):
    # A block may show one statement of a larger program (a bare `await`): parse it as a body.
    source = "async def _block():\n" + "".join("    " + line + "\n" for line in block.source.splitlines())
    tree = ast.parse(source)
    imports, attributes = names_used(tree)
    for module, name in imports:
        mod = importlib.import_module(module)
        assert not name or hasattr(mod, name), f"{block}: {module} has no {name}"
    missing = [a for a in attributes if not hasattr(meshtrain, a)]
    assert not missing, f"{block}: meshtrain has no {missing}"


WHOLE_PROGRAMS = [b for b in PYTHON if re.search(r"^trio\.run\(", b.source, re.M)]


@pytest.mark.parametrize("block", WHOLE_PROGRAMS, ids=str)
def test_the_whole_programs_run(block, tmp_path):
    r = subprocess.run([sys.executable, "-c", block.source], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{block}:\n{r.stderr[-3000:]}"


def test_some_blocks_are_whole_programs():
    assert WHOLE_PROGRAMS
