"""Built-in model and data: a small GPT that can be cut into pipeline stages, and an offline
corpus whose data assignment is a pure function of (seed, peer, step). No downloads."""

from meshtrain.models.corpus import Corpus, Vocab
from meshtrain.models.gpt import GPT, GPTConfig, GPTOutput, ModelInputError, PipelineStage

__all__ = ["GPT", "Corpus", "GPTConfig", "GPTOutput", "ModelInputError", "PipelineStage", "Vocab"]
