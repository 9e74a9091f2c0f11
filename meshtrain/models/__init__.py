"""Built-in model and data: a small GPT that can be cut into pipeline stages, and an offline
corpus whose data assignment is a pure function of (seed, peer, step). No downloads.

Submodules beside them: `sources` (where a swarm's model comes from: presets, hf:, hf-config:,
py:), `staged` (the models a pipeline can cut: the GPT and transformers causal LMs of the families it knows),
`tokenizers`."""

from meshtrain.models.corpus import Corpus, Vocab
from meshtrain.models.gpt import GPT, GPTConfig, GPTOutput, ModelInputError, PipelineStage

__all__ = ["GPT", "Corpus", "GPTConfig", "GPTOutput", "ModelInputError", "PipelineStage", "Vocab"]
