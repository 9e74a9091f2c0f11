"""The swarm spec's `verification` and `admission` sections: how owners check the updates they
combine, when a flagged peer is excluded, and who may take part (the spec's sections:
meshtrain/spec_section.py).

Verification's rule (`check`): a strikes window holds at least `strikes` rounds. Whether its
checks run at all depends on the aggregation section (only screened rounds keep contributions to
check), and a spot-check on the outer section (diloco, at most H steps): `SwarmSpec` checks those
(node/spec/swarm.py).

Not here: the checks (scoring.py, spot_check.py, strikes.py), admitting a peer (admission.py).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator

from meshtrain.errors import ConfigError
from meshtrain.spec_section import SpecSection

DEFAULT_POW_BITS = 16  # ~65k hashes: ~0.1 s for one identity in Python, a thousand cost a thousand times that
MAX_POW_BITS = 32
MAX_ALLOWLIST = 256  # peer ids in the signed spec (it must fit a swarm advert; more at run time, in the config CRDT)


class VerificationSection(SpecSection):
    """Loss scoring, replay spot-checks and strikes."""

    score_samples: int = Field(
        2,
        ge=0,
        le=64,
        description="loss scoring (node/trust/scoring.py): in each screened round this many peers, drawn from the "
        "round's committed digest, have their update applied to each owner's part of the outer parameters "
        "and its loss measured on their own assigned batches (score_batches); 0 = off; only where screening is on",
    )
    score_ratio: float = Field(
        0.5,
        ge=0,
        le=1,
        description="loss scoring: flag an update whose loss drop on its own assigned batches is below this "
        "fraction of the round aggregate's drop there by more than score_floor; a batch the aggregate did not lower "
        "by more than score_floor is not scored",
    )
    score_floor: float = Field(
        2e-3,
        ge=0,
        le=1,
        description="loss scoring: slack, as a fraction of the loss, below which a shortfall is noise, not evidence",
    )
    score_batches: int = Field(
        4,
        ge=1,
        le=64,
        description="loss scoring: the sampled peer's assigned batches of the round's last this many inner steps "
        "(all H if fewer) are scored, the loss their mean; more batches, less chance in an honest peer's score, and "
        "3 forward passes per batch, sampled peer and owner each round",
    )
    spot_check_steps: int = Field(
        0,
        ge=0,
        le=1 << 20,
        description="replay spot-check (node/trust/spot_check.py): every owner recomputes this many first inner steps "
        "of the round's sampled peers from the outer parameters on their assigned batches and compares the result "
        "with their update on its part; costs this many training steps per sampled peer and owner each round; "
        "0 = off; at most H; diloco only, and only where screening is on",
    )
    spot_check_samples: int = Field(
        1,
        ge=1,
        le=64,
        description="replay spot-check: peers checked per round, drawn from the round's committed digest",
    )
    spot_check_margin: float = Field(
        0.2,
        ge=0,
        le=2,
        description="replay spot-check: flag an update whose cosine with the recomputation is below the round "
        "aggregate's cosine with it by more than this",
    )
    strikes: int = Field(
        3,
        ge=0,
        le=1000,
        description="a peer flagged in this many distinct rounds (by 2+ reporters each) within "
        "strikes_window rounds is excluded everywhere (node/trust/strikes.py); 0 = never",
    )
    strikes_window: int = Field(
        6,
        ge=0,
        le=1 << 20,
        description="the strikes that exclude a peer must fall within this many consecutive rounds "
        "(H steps each), so chance flags of an honest peer over a long run add up to nothing; "
        "0 = no window (strikes count forever); else at least strikes",
    )

    @property
    def kept_samples(self) -> int:
        """How many sampled peers' contributions a screened round keeps for the node's checks:
        loss scoring's and the spot-check's, whichever samples more."""
        return max(self.score_samples, self.spot_check_samples if self.spot_check_steps else 0)

    def check(self) -> None:
        if self.strikes_window and self.strikes_window < self.strikes:
            raise ConfigError(
                f"swarm spec: strikes_window ({self.strikes_window}) must be 0 (no window) or at least "
                f"strikes ({self.strikes})"
            )


class AdmissionSection(SpecSection):
    """Who may take part in the swarm (admission.py)."""

    flat_names: ClassVar[dict[str, str]] = {"mode": "admission"}

    mode: Literal["open", "allowlist", "private"] = Field(
        "open",
        description="who may take part (node/trust/admission.py): open (anyone with a proof of work on its "
        "peer id), allowlist (the owner and the peer ids the owner signs), private (holders of the swarm key; "
        "`swarm create --private` makes one)",
    )
    pow_bits: int = Field(
        DEFAULT_POW_BITS,
        ge=0,
        le=MAX_POW_BITS,
        description="open admission: leading zero bits of the proof of work on each peer id "
        "(an identity costs about 2**pow_bits hashes; 0 = none)",
    )
    allowlist: tuple[str, ...] = Field(
        (),
        max_length=MAX_ALLOWLIST,
        description="allowlist admission: peer ids admitted from the start (more at run time: "
        "`meshtrain swarm allow <peer id>` on the owner's node)",
    )

    @field_validator("allowlist")
    @classmethod
    def _allowlist(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        from meshtrain.transport.identity import IdentityError, public_key_of

        for peer in v:
            try:
                public_key_of(peer)
            except IdentityError:
                raise ValueError(f"{peer!r:.70} is not a peer id (12D3KooW...)") from None
        return tuple(dict.fromkeys(v))
