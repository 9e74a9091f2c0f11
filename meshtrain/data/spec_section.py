"""The swarm spec's `data` section: what every peer trains on and evaluates with, and how much
per step (the spec's sections: meshtrain/spec_section.py).

Not here: reading, assigning and packing the data (documents.py, assignment.py, packed.py); the
dataset's digest is computed by `swarm create` (`meshtrain.data.dataset_digest`).
"""

from __future__ import annotations

from pydantic import Field

from meshtrain.spec_section import SpecSection


class DataSection(SpecSection):
    """The swarm's training and held-out data, batch size and evaluation cadence."""

    dataset: str = Field(
        "builtin",
        description="builtin (offline English text), or a text, JSONL or Parquet file or directory, at the same path "
        "on every peer (meshtrain.data)",
    )
    dataset_field: str = Field(
        "text", min_length=1, max_length=256, description="JSONL/Parquet: the field that holds a document's text"
    )
    held_out: float = Field(
        0.05, gt=0, lt=1, description="fraction of a file dataset's documents held out for evaluation (chosen by hash)"
    )
    eval_dataset: str = Field("", description="held-out data as its own file or directory (instead of held_out)")
    dataset_digest: str = Field(
        "",
        pattern=r"^([0-9a-f]{64})?$",
        description="content digest of the dataset's files (swarm create "
        "computes it; peers whose files differ are refused)",
    )
    batch_size: int = Field(
        16, ge=1, le=4096, description="sequences a peer trains per inner step (a multi-rank peer splits them)"
    )
    eval_every: int = Field(50, ge=0, description="held-out evaluation every this many steps")
    eval_batches: int = Field(
        8, ge=1, le=1024, description="held-out batches per evaluation, of batch_size sequences each"
    )
