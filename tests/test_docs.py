"""The documentation stays true to the tree: the configuration reference is the one the models
render (meshtrain/node/spec/reference.py), every relative link in README.md and docs/ reaches a
file (and a heading, where it names one), and every benchmark output in docs/bench/ is in its
index. Pure file reads; no network, no node."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from meshtrain.node.spec import reference

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def test_configuration_reference_is_rendered_from_the_models():
    page = (DOCS / "configuration.md").read_text()
    assert page == reference.render(), f"docs/configuration.md is out of date: run {reference.COMMAND}"


def test_configuration_reference_names_every_key_of_both_models():
    from meshtrain.node.spec.config import NodeConfig
    from meshtrain.node.spec.swarm import FLAT_KEYS

    page = reference.render()
    spec_keys = [field if section is None else f"{section}.{field}" for section, field in FLAT_KEYS.values()]
    for name in [*NodeConfig.model_fields, *spec_keys]:
        assert f"| `{name}` |" in page, name


def _prose(text: str) -> str:
    """The text outside fenced code blocks and code spans: where a link is a link."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    return "".join(c for c in text if c.isalnum() or c in " -_").replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in _HEADING.findall(_FENCE.sub("", page.read_text())):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _relative_links(page: Path) -> list[str]:
    return [t for t in _LINK.findall(_prose(page.read_text())) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_a_file_and_its_heading(page):
    broken = []
    for target in _relative_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_every_benchmark_output_is_in_the_index():
    listed = {Path(t).name for t in _relative_links(DOCS / "bench" / "README.md")}
    missing = [p.name for p in sorted((DOCS / "bench").iterdir()) if p.name != "README.md" and p.name not in listed]
    assert not missing, f"docs/bench/README.md does not list: {missing}"


def test_the_readme_stays_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move detail into docs/"
    assert "## Two commands" in "\n".join(lines)
