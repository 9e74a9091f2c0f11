"""The swarm spec's `aggregation` section: how every all-reduce of the swarm combines the peers'
contributions, and how each part's owner screens them (the spec's sections:
meshtrain/spec_section.py).

`options` is the one place the section reaches `AllReduceConfig` (protocol.py), for every
all-reduce the swarm runs. Its default rule depends on other sections (robust in a swarm open to
strangers whose optimizer all-reduces dense contributions), so `SwarmSpec` sets it
(node/spec/swarm.py); so does the number of contributions a screened round keeps for the node's
checks (`kept_samples`, the verification section's).

Not here: the rules themselves (data_phase.py), replay screening (echoes.py).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, get_args

from pydantic import Field

from meshtrain.errors import ConfigError
from meshtrain.spec_section import SpecSection

# How every all-reduce of the swarm combines the peers' contributions (data_phase.py).
Aggregation = Literal["mean", "trimmed_mean", "clipped_mean"]
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)


class AggregationSection(SpecSection):
    """The all-reduce's combination rule and the screening of what it combines."""

    flat_names: ClassVar[dict[str, str]] = {
        "rule": "aggregation",
        "trim": "aggregation_trim",
        "clip": "aggregation_clip",
    }

    rule: Aggregation = Field(
        "mean",
        description="how every all-reduce combines the peers' contributions: mean | trimmed_mean "
        "(per coordinate, the aggregation_trim largest and smallest dropped) | clipped_mean (each "
        "contribution clipped to aggregation_clip x the median norm); robust rules need 3+ peers "
        "(with fewer they are the mean). Default: trimmed_mean in an open swarm whose optimizer "
        "all-reduces dense contributions (diloco, streaming, dp), else mean",
    )
    trim: int = Field(
        0,
        ge=0,
        le=1024,
        description="trimmed_mean: values dropped at each end (at most (n-1)/2 of n peers); 0 (default): a "
        "quarter of the round's contributors, at least one",
    )
    clip: float = Field(
        2.0, gt=0, le=1e6, description="clipped_mean: contributions clipped to this multiple of the median norm"
    )
    screen_norm: float = Field(
        4.0,
        ge=0,
        le=1e6,
        description="robust aggregation: each part's owner flags a contribution whose norm is over this "
        "multiple of the median or under its inverse (0 = no screening; else > 1)",
    )
    screen_alignment: float = Field(
        0.25,
        ge=0,
        le=1,
        description="robust aggregation: flag a contribution whose cosine with the aggregate is below this "
        "fraction of the group's median cosine (a flipped update, or noise; 0 = no direction rule)",
    )
    screen_echo: float = Field(
        0.9999,
        ge=0,
        le=1,
        description="robust aggregation: flag a contribution whose cosine with a contribution or aggregate of "
        "the owner's part in one of its last 8 rounds is at least this (a replayed update; honest updates of "
        "different rounds stayed below 0.9987 even at H = 2); 0 = off; only where screening is on",
    )

    @property
    def robust(self) -> bool:
        return self.rule != "mean"

    @property
    def screened(self) -> bool:
        """Whether owners screen what they combine: screening needs a part's contributions side by
        side, which only robust rules keep."""
        return self.robust and bool(self.screen_norm)

    def check(self) -> None:
        if self.screen_norm and self.screen_norm <= 1:
            raise ConfigError(f"swarm spec: screen_norm must be 0 (no screening) or above 1, not {self.screen_norm}")

    def options(self, kept_samples: int) -> dict[str, Any]:
        """The all-reduce's combination rule (`AllReduceConfig` fields) for this swarm, keeping
        `kept_samples` sampled peers' contributions of screened rounds for the node's checks."""
        return {
            "robust": self.rule if self.robust else "none",
            "trim": self.trim,
            "clip": self.clip,
            "screen_norm": self.screen_norm if self.robust else 0.0,
            "screen_alignment": self.screen_alignment,
            "screen_echo": self.screen_echo if self.screened else 0.0,
            # Loss scoring (node/trust/scoring.py) and spot-checks (node/trust/spot_check.py) keep a few
            # contributions of screened rounds: the larger sample holds the smaller (`sampled_peers`).
            "score_samples": kept_samples if self.screened else 0,
        }
