#!/usr/bin/env python3
"""Structure check of meshtrain's import graph: no import cycles, no upward imports across the
layers, no private names imported from another module.

A repo copy of the steering repo's `shared/tools/structure.py` (cycles, private imports; same
rules, so the two agree), with the layering rule of docs/architecture.md added: a layer
imports only the layers below it. tests/test_structure.py runs it with the suite, and
.pre-commit-config.yaml before a commit.

What counts as an import: every `import`/`from ... import` of a `meshtrain` module in the file,
wherever it stands (inside a function, under `if TYPE_CHECKING:`): each can close a cycle or
tie a layer to one above it.

usage: python scripts/check_structure.py [ROOT]   (ROOT: the checkout, default: this one)
Prints one JSON line and exits 1 when anything is found.
"""

from __future__ import annotations

import ast
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "meshtrain"

# The stack (docs/architecture.md, "Layers"): a package may import its own layer and the layers
# below it. The modules directly in meshtrain/ (errors, log, lifecycle, ...) are below them all.
RANK = {"transport": 1, "crdt": 2, "dht": 2, "collective": 3, "optim": 4, "pipeline": 4, "node": 5, "integrations": 6}
# Beside the stack: models/ and data/, which import only these, and which only BESIDE_USERS import.
BESIDE = {"data": {"transport"}, "models": {"transport", "data"}}
BESIDE_USERS = {"pipeline", "node"}


@dataclass
class Report:
    cycles: list[list[str]] = field(default_factory=list)  # modules of each import cycle
    upward: list[str] = field(default_factory=list)  # "file: imports module (layer -> layer)"
    private: list[str] = field(default_factory=list)  # "file: _name from module"
    unlayered: list[str] = field(default_factory=list)  # subpackages in neither RANK nor BESIDE

    @property
    def ok(self) -> bool:
        return not (self.cycles or self.upward or self.private or self.unlayered)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def may_import(importer: str | None, imported: str | None) -> bool:
    if imported is None or importer == imported:
        return True
    if importer is None:  # the base modules import no layer
        return False
    if importer in BESIDE:
        return imported in BESIDE[importer]
    if imported in BESIDE:
        return importer in BESIDE_USERS
    return RANK[imported] <= RANK[importer]


def imports_of(tree: ast.AST, name: str, is_package: bool, modules: dict[str, Path]) -> tuple[set[str], list[str]]:
    """(the meshtrain modules `name` imports, the private names it imports from other modules)."""
    pkg = name if is_package else name.rsplit(".", 1)[0]
    deps: set[str] = set()
    private: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith(PACKAGE):
                continue
            for alias in node.names:
                full = f"{target}.{alias.name}"
                if full in modules:
                    deps.add(full)
                elif target in modules:
                    deps.add(target)
                    if alias.name.startswith("_") and not alias.name.startswith("__") and target != name:
                        private.append(f"{alias.name} from {target}")
        elif isinstance(node, ast.Import):
            deps.update(alias.name for alias in node.names if alias.name in modules)
    deps.discard(name)
    return deps, private


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """The components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def check(root: Path) -> Report:
    top = root / PACKAGE
    files = sorted(top.rglob("*.py"))
    modules = {module_name(f, root): f for f in files}
    layers = {d.name for d in top.iterdir() if (d / "__init__.py").is_file()}
    report = Report()
    report.unlayered = sorted(layers - RANK.keys() - BESIDE.keys())

    def layer_of(module: str) -> str | None:
        """The subpackage `module` belongs to; None for the modules directly in meshtrain/."""
        parts = module.split(".")
        return parts[1] if len(parts) > 1 and parts[1] in layers else None

    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        deps, private = imports_of(tree, name, path.name == "__init__.py", modules)
        edges[name] = deps
        shown = path.relative_to(root)
        report.private += [f"{shown}: {p}" for p in private]
        mine = layer_of(name)
        for dep in sorted(deps):
            theirs = layer_of(dep)
            if mine in report.unlayered or theirs in report.unlayered:
                continue  # placed nowhere yet: reported as unlayered
            if not may_import(mine, theirs):
                report.upward.append(f"{shown}: imports {dep} ({mine or 'base'} -> {theirs})")
    report.cycles = strongly_connected(edges)
    return report


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent
    report = check(root)
    summary = {
        "cycles": len(report.cycles),
        "cycle_members": report.cycles[:5],
        "upward_imports": len(report.upward),
        "upward_examples": report.upward[:5],
        "private_imports": len(report.private),
        "private_examples": report.private[:5],
        "unlayered": report.unlayered,
    }
    print(("OK | " if report.ok else "SHORT | ") + json.dumps(summary))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
