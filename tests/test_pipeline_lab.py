"""The pipeline lab file (node/stages/lab.py): regions pick the near or far link, the lab's
forward times are what the daemon announces, and a malformed file is a one-line ConfigError."""

from __future__ import annotations

import json

import pytest

from meshtrain.errors import ConfigError
from meshtrain.node.spec.config import load_node_config
from meshtrain.node.stages.lab import PipelineLab
from meshtrain.pipeline.scheduler import Link


def test_regions_choose_the_link_and_unknown_peers_are_near(tmp_path):
    path = tmp_path / "lab.json"
    lab = {
        "regions": {"a": "r0", "b": "r0", "c": "r1"},
        "near": [0.005, 2e7],
        "far": [0.04, 2e6],
        "forward_s": {"a": 0.03},
    }
    path.write_text(json.dumps(lab))
    parsed = PipelineLab.load(load_node_config(environ={"MESHTRAIN_PIPELINE_LAB": str(path)}).pipeline_lab)
    assert parsed.link("a", "b") == Link(0.005, 2e7) and parsed.link("b", "a") == Link(0.005, 2e7)
    assert parsed.link("a", "c") == Link(0.04, 2e6) and parsed.link("c", "b") == Link(0.04, 2e6)
    assert parsed.link("a", "stranger") == Link(0.005, 2e7)
    assert parsed.forward_s == {"a": 0.03}


@pytest.mark.parametrize(
    "body, match",
    [
        ("not json", "cannot read"),
        ("[]", "JSON object"),
        ('{"near": [0.1], "far": [0.1, 1e6]}', "near must be"),
        ('{"near": [0.1, 1e6], "far": [0.1, 0]}', "far must be"),
        ('{"near": [0.1, 1e6], "far": [0.1, 1e6], "forward_s": {"a": -1}}', "forward_s"),
        ('{"near": [0.1, 1e6], "far": [0.1, 1e6], "regions": {"a": 3}}', "regions"),
    ],
)
def test_a_malformed_lab_file_is_a_config_error(tmp_path, body, match):
    path = tmp_path / "lab.json"
    path.write_text(body)
    with pytest.raises(ConfigError, match=match):
        PipelineLab.load(path)
    with pytest.raises(ConfigError, match="cannot read"):
        PipelineLab.load(tmp_path / "missing.json")
