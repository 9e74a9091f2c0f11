"""Tiny model artefacts built offline for tests: a LLaMA-family causal LM saved with
`save_pretrained`, a byte-level BPE tokenizer trained with `tokenizers` on the built-in corpus
text (CPython's pydoc topics), and the source of a py: model factory. Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

BPE_VOCAB = 300

# A py: model factory module (a bigram table; forward(x) gives logits, forward(x, y) the loss).
FACTORY = """
import torch


class Bigram(torch.nn.Module):
    context = 16

    def __init__(self, vocab_size):
        super().__init__()
        self.table = torch.nn.Embedding(vocab_size, vocab_size)

    def forward(self, x, y=None):
        logits = self.table(x)
        if y is None:
            return logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def make(vocab_size):
    return Bigram(vocab_size)


def not_a_model(vocab_size):
    return 3
"""


def corpus_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def train_bpe(
    out: Path, *, vocab_size: int = BPE_VOCAB, transformers_dir: bool = True, texts: list[str] | None = None
) -> Path:
    """A byte-level BPE with an <|endoftext|> token, trained on `texts` (default: the built-in
    corpus text): `out/` in transformers' layout (tokenizer.json + tokenizer_config.json), or
    only `out/tokenizer.json`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        [corpus_text()] if texts is None else texts,
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<|endoftext|>"],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    out.mkdir(parents=True, exist_ok=True)
    if not transformers_dir:
        tok.save(str(out / "tokenizer.json"))
        return out
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(str(out))
    return out


def save_tiny_llama(out: Path, *, vocab_size: int = BPE_VOCAB, seed: int = 0, **overrides: object) -> Path:
    """A 2-layer LLaMA (hidden 32, 2 heads, 64 positions) with weights from `seed`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **{
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "vocab_size": vocab_size,
            "max_position_embeddings": 64,
            "bos_token_id": None,
            "eos_token_id": 0,
            "pad_token_id": None,
            **overrides,
        }
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(str(out))
    return out
