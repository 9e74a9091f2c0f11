"""A pipeline swarm's lab: simulated links and compute for many daemons on one machine.

Problem. scripts/bench/bench_skippipe.py measures SkipPipe's library runtime on heterogeneous links and
peers that one machine does not have, by throttling in user space (`SimulatedLinks`: every send
first waits latency + bytes / bandwidth; `compute_floor`: every visit is padded to the cost
model's time). A benchmark of the same setting through the daemons (`meshtrain node start`) must
throttle the same way, or the two are not comparable. This file is how a daemon is told to.

Design. `NodeConfig.pipeline_lab` (or `MESHTRAIN_PIPELINE_LAB`) names a JSON file, the same for
every daemon of the lab:

    {"regions": {peer_id: region}, "near": [latency_s, bytes_per_s], "far": [latency_s, bytes_per_s],
     "forward_s": {peer_id: seconds}}

Peers in one region are linked by `near`, others by `far`; a peer that the file does not name is
linked by `near` to everyone. A peer announces its `forward_s` (not its measured forward time), so
the scheduler and placement see the simulated speeds, and pads its visits to it. The pipeline peer
(node/stages/peer.py) hands the links to its scheduler problem and `PipelineRuntime(links=,
compute_floor=)`; the runtime also charges the replica sync's bytes to the slowest replica link
(`PipelineRuntime.account_sync`). Peer ids are known before a daemon starts (its identity.key in
its data dir), so the file is complete at launch.

Failures: an unreadable or malformed file is a `ConfigError` (one line) at start.

Not here: anything a real swarm needs — outside a lab this file is never read.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshtrain.errors import ConfigError
from meshtrain.pipeline.scheduler import Link


def _link(raw: Any, what: str) -> Link:
    if not (
        isinstance(raw, list)
        and len(raw) == 2
        and all(isinstance(v, int | float) and math.isfinite(v) for v in raw)
        and raw[0] >= 0
        and raw[1] > 0
    ):
        raise ConfigError(f"pipeline lab: {what} must be [latency seconds >= 0, bytes per second > 0], got {raw!r}")
    return Link(float(raw[0]), float(raw[1]))


@dataclass(frozen=True)
class PipelineLab:
    """The lab file, parsed (module docstring)."""

    regions: dict[str, str]
    near: Link
    far: Link
    forward_s: dict[str, float] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> PipelineLab:
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"pipeline lab: cannot read {path}: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"pipeline lab: {path} must hold a JSON object")
        regions, fwd = raw.get("regions", {}), raw.get("forward_s", {})
        if not isinstance(regions, dict) or not all(isinstance(v, str) for v in regions.values()):
            raise ConfigError("pipeline lab: regions must map peer ids to region names")
        if not isinstance(fwd, dict) or not all(
            isinstance(v, int | float) and math.isfinite(v) and v > 0 for v in fwd.values()
        ):
            raise ConfigError("pipeline lab: forward_s must map peer ids to positive seconds")
        return cls(
            dict(regions),
            _link(raw.get("near"), "near"),
            _link(raw.get("far"), "far"),
            {k: float(v) for k, v in fwd.items()},
        )

    def link(self, a: str, b: str) -> Link:
        ra, rb = self.regions.get(a), self.regions.get(b)
        return self.far if ra is not None and rb is not None and ra != rb else self.near
