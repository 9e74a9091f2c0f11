"""The import graph keeps its shape (scripts/check_structure.py): no import cycles, no upward
imports across the layers of shared/ARCHITECTURE.md, no private names imported from another
module. And the check finds each of those where one is."""

from __future__ import annotations

from pathlib import Path

from scripts.check_structure import check

ROOT = Path(__file__).resolve().parent.parent


def test_meshtrain_has_no_cycles_upward_or_private_imports() -> None:
    report = check(ROOT)
    assert report.cycles == []
    assert report.upward == []
    assert report.private == []
    assert report.unlayered == []  # a new subpackage: give it a place in check_structure.RANK or BESIDE
    assert report.ok


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "meshtrain" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for package in {p.parent for p in (root / "meshtrain").rglob("*.py")}:
        (package / "__init__.py").touch()
    return root


def test_check_finds_cycles_upward_private_and_unlayered_imports(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "errors.py": "",
            "transport/a.py": "from meshtrain.transport import b\n",
            "transport/b.py": "def f():\n    from meshtrain.transport.a import x\n",  # a cycle, however deep
            "collective/c.py": "from meshtrain.transport.a import _hidden\nfrom meshtrain.errors import E\n",
            "crdt/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from meshtrain.optim import o\n",
            "optim/o.py": "from ..collective import c\nfrom . import p\n",  # down, and within the layer
            "optim/p.py": "from meshtrain.models import m\n",  # models/ is for pipeline/ and node/
            "models/m.py": "from meshtrain.data import q\n",
            "data/q.py": "",
            "extra/e.py": "from meshtrain.node import n\n",
        },
    )
    report = check(root)
    assert report.cycles == [["meshtrain.transport.a", "meshtrain.transport.b"]]
    assert report.private == ["meshtrain/collective/c.py: _hidden from meshtrain.transport.a"]
    assert report.upward == [
        "meshtrain/crdt/d.py: imports meshtrain.optim.o (crdt -> optim)",
        "meshtrain/optim/p.py: imports meshtrain.models.m (optim -> models)",
    ]
    assert report.unlayered == ["extra"]
    assert not report.ok


def test_check_passes_a_clean_tree(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "log.py": "",
            "transport/t.py": "from meshtrain.log import get_logger\n",
            "node/n.py": "import meshtrain.transport.t\nfrom meshtrain.models import m\n",
            "pipeline/s.py": "from meshtrain.optim.o import Outer\n",  # one layer: pipeline/ uses optim/
            "optim/o.py": "",
            "models/m.py": "from meshtrain.transport.t import is_int\n",
        },
    )
    assert check(root).ok
