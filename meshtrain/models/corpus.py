"""Offline training text, its vocabulary, and which samples each peer trains on at each step.

Why: the demo and the convergence benchmark must run with no network and no downloads. The
default corpus is CPython's `pydoc_data.topics` (~465 KB of English in the standard library; its
topics joined in sorted key order). It changes between Python versions, so `Corpus.source`
records `sys.version` and `Corpus.digest` fingerprints the exact token stream: peers that must
train on the same data compare digests, not promises. `Corpus.from_file` takes a user's text.

Vocabulary: "chars" is the sorted set of the text's characters (deterministic, small — 103
symbols for the topics — but it depends on the text); "bytes" is the 256 byte values of the
UTF-8 encoding, the same for every text, so a model's shape never depends on the data.

Data assignment is a pure function, as in Psyche (which assigns each client its data from the
round and the client's identity): `batch(..., seed, peer, step)` draws random windows of the
training split from the private generator `meshtrain.data.assignment` derives from (seed, peer,
step, microbatch). Peers therefore draw different samples without coordinating, and a peer restarted
at step s draws exactly what it would have drawn — it neither repeats nor skips work. The
global RNG is never touched. Windows are sampled with replacement; nothing guarantees two peers
never see the same window, only that their streams are independent.

The last 10% of the tokens (by default) is held out; `eval_batches` reads fixed, evenly spaced
windows of it, so every peer evaluates on the same batches.

`from_parts(train, held_out, vocab)` takes token ids the caller has already split (by document,
say, so no held-out document is ever trained on); held_out_start is then where `train` ends.

Any `Tokenizer` (models/tokenizers.py: a Hugging Face BPE, say) may stand in for the vocabulary:
`Corpus.default(tokenizer)`, `from_text(text, vocab=tokenizer)`, `from_file(path, tokenizer)`
tokenise the whole text with it; the digest then covers the tokenizer's digest.

What it does not do: streaming corpora larger than memory (file datasets: `meshtrain.data`).
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from meshtrain.data.assignment import assignment_generator, check_positive
from meshtrain.errors import ConfigError
from meshtrain.transport.validate import is_number

if TYPE_CHECKING:
    from meshtrain.models.tokenizers import Tokenizer

DEFAULT_HELD_OUT = 0.1
# The context a corpus is checked against at load when the caller names none: GPTConfig's default.
DEFAULT_CONTEXT = 32

VocabKind = Literal["chars", "bytes"]


@dataclass(frozen=True)
class Vocab:
    """Maps text to token ids and back.

    chars: for a character vocabulary, its symbols in id order (sorted); None for the byte
        vocabulary (ids are UTF-8 byte values, 256 symbols).
    """

    chars: str | None

    @classmethod
    def of_bytes(cls) -> Vocab:
        return cls(None)

    @classmethod
    def from_text(cls, text: str) -> Vocab:
        return cls("".join(sorted(set(text))))

    @property
    def kind(self) -> VocabKind:
        return "bytes" if self.chars is None else "chars"

    @property
    def size(self) -> int:
        return 256 if self.chars is None else len(self.chars)

    @property
    def vocab_size(self) -> int:
        """`size`, under the `Tokenizer` protocol's name."""
        return self.size

    @property
    def eos_id(self) -> int | None:
        """No end-of-text token: every id is a symbol of the text."""
        return None

    @property
    def digest(self) -> str:
        """Fingerprint of the id <-> symbol mapping."""
        h = hashlib.blake2b(digest_size=16)
        h.update(self.kind.encode())
        if self.chars is not None:
            h.update(self.chars.encode("utf-8", errors="surrogatepass"))
        return h.hexdigest()

    def encode(self, text: str) -> torch.Tensor:
        """text -> 1-D int64 ids. A character outside a "chars" vocabulary is a ConfigError."""
        if self.chars is None:
            return _bytes_to_tensor(text.encode("utf-8")).long()
        index = {c: i for i, c in enumerate(self.chars)}
        try:
            return torch.tensor([index[c] for c in text], dtype=torch.int64)
        except KeyError as e:
            raise ConfigError(
                f"character {e.args[0]!r} is not in this corpus' vocabulary; use vocab='bytes' to accept any text"
            ) from None

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        if self.chars is None:
            return bytes(values).decode("utf-8", errors="replace")
        return "".join(self.chars[i] for i in values)


@dataclass(frozen=True, eq=False)
class Corpus:
    """A token stream split into a training part and a held-out tail.

    source: where the text came from (for the default corpus, including `sys.version`).
    vocab: the `Vocab` (or `Tokenizer`) that produced `tokens`.
    tokens: every token id, 1-D (uint8 when the vocabulary fits a byte, else int32; batches are
        int64).
    held_out_start: tokens[:held_out_start] is `train`, the rest `held_out`.
    digest: fingerprint of (vocab, tokens, split), for peers to check they hold the same data.
    """

    source: str
    vocab: Vocab | Tokenizer
    tokens: torch.Tensor = field(repr=False)
    held_out_start: int
    digest: str = field(repr=False)

    # -- constructors --------------------------------------------------------------------------

    @classmethod
    def default(cls, vocab: VocabKind | Tokenizer = "chars", *, held_out_fraction: float = DEFAULT_HELD_OUT) -> Corpus:
        """CPython's `pydoc_data.topics`, topics joined in sorted key order."""
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[key] for key in sorted(topics))
        return cls.from_text(
            text, f"pydoc_data.topics, Python {sys.version}", vocab, held_out_fraction=held_out_fraction
        )

    @classmethod
    def from_text(
        cls,
        text: str,
        source: str = "<text>",
        vocab: VocabKind | Tokenizer = "chars",
        *,
        held_out_fraction: float = DEFAULT_HELD_OUT,
        context: int = DEFAULT_CONTEXT,
    ) -> Corpus:
        """Tokenise `text`; both splits must hold at least context + 1 tokens."""
        if not isinstance(vocab, str):  # a Tokenizer
            return cls._build(
                torch.tensor(vocab.encode(text), dtype=torch.int64), vocab, source, held_out_fraction, context
            )
        if vocab == "chars":
            table = Vocab.from_text(text)
            return cls._build(table.encode(text), table, source, held_out_fraction, context)
        if vocab == "bytes":
            return cls._build(
                _bytes_to_tensor(text.encode("utf-8")), Vocab.of_bytes(), source, held_out_fraction, context
            )
        raise ConfigError(f"vocab must be 'chars' or 'bytes', got {vocab!r}")

    @classmethod
    def from_file(
        cls,
        path: str | Path,
        vocab: VocabKind | Tokenizer = "chars",
        *,
        held_out_fraction: float = DEFAULT_HELD_OUT,
        context: int = DEFAULT_CONTEXT,
    ) -> Corpus:
        """A user's text file: UTF-8 for vocab="chars" or a Tokenizer; any bytes for vocab="bytes". A missing,
        unreadable, empty or too short file (fewer than context + 1 tokens in either split) is a
        ConfigError that says which."""
        path = Path(path)
        if isinstance(vocab, str) and vocab not in ("chars", "bytes"):
            raise ConfigError(f"vocab must be 'chars' or 'bytes', got {vocab!r}")
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise ConfigError(f"corpus file {path} does not exist") from None
        except OSError as e:
            raise ConfigError(f"cannot read corpus file {path}: {e.strerror or e}") from None
        if not raw:
            raise ConfigError(f"corpus file {path} is empty")
        source = str(path)
        if vocab == "bytes":
            return cls._build(_bytes_to_tensor(raw), Vocab.of_bytes(), source, held_out_fraction, context)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"corpus file {path} is not UTF-8 text ({e.reason} at byte "
                f"{e.start}); use vocab='bytes' to train on raw bytes"
            ) from None
        return cls.from_text(text, source, vocab, held_out_fraction=held_out_fraction, context=context)

    @classmethod
    def from_parts(
        cls,
        train: torch.Tensor,
        held_out: torch.Tensor,
        vocab: Vocab | Tokenizer,
        source: str = "<parts>",
        *,
        context: int = DEFAULT_CONTEXT,
    ) -> Corpus:
        """Token ids the caller has split (module docstring): `train` then `held_out`, 1-D, each
        at least context + 1 tokens long (else a ConfigError that says which)."""
        ids = torch.cat([train.reshape(-1).long(), held_out.reshape(-1).long()])
        return cls._build(ids, vocab, source, None, context, held_out_start=train.numel())

    @classmethod
    def _build(
        cls,
        ids: torch.Tensor,
        vocab: Vocab | Tokenizer,
        source: str,
        held_out_fraction: float | None,
        context: int,
        *,
        held_out_start: int | None = None,
    ) -> Corpus:
        fraction = 0.0 if held_out_fraction is None else held_out_fraction  # None: from_parts' own split
        if held_out_start is None and (not is_number(fraction) or not 0.0 < fraction < 1.0):
            raise ConfigError(f"held_out_fraction must be in (0, 1), got {held_out_fraction!r}")
        check_positive("context", context)
        n = len(ids)
        if n == 0:
            raise ConfigError(f"corpus {source} is empty")
        if held_out_start is None:
            held_out_start = int(n * (1.0 - fraction))
        shortest = min(held_out_start, n - held_out_start)
        if shortest < context + 1:
            raise ConfigError(
                f"corpus {source} is too short: {n} tokens split {held_out_start} train / "
                f"{n - held_out_start} held out, and each part needs at least context + 1 = "
                f"{context + 1} tokens"
            )
        tokens = ids.to(torch.uint8 if vocab.vocab_size <= 256 else torch.int32).contiguous()
        h = hashlib.blake2b(digest_size=16)
        h.update(vocab.digest.encode())
        h.update(held_out_start.to_bytes(8, "little"))
        h.update(str(tokens.dtype).encode())
        h.update(tokens.numpy().tobytes())
        return cls(source, vocab, tokens, held_out_start, h.hexdigest())

    # -- views ---------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.vocab.vocab_size

    @property
    def train(self) -> torch.Tensor:
        return self.tokens[: self.held_out_start]

    @property
    def held_out(self) -> torch.Tensor:
        return self.tokens[self.held_out_start :]

    # -- sampling ------------------------------------------------------------------------------

    def batch(
        self, batch_size: int, context: int, *, seed: int, peer: str | int, step: int, microbatch: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The (inputs, targets) `peer` trains on at `step`: int64 [batch_size, context] each,
        targets shifted by one token. A pure function of the arguments (and the corpus): peer 3
        and peer "3" are the same peer. `microbatch` tells apart several batches of one step
        (e.g. a pipeline's microbatches)."""
        generator = assignment_generator(batch_size, context, seed=seed, peer=peer, step=step, microbatch=microbatch)
        train = self.train
        self._check_long_enough(len(train), context, "training")
        starts = torch.randint(0, len(train) - context, (batch_size,), generator=generator)
        return _windows(train, starts, context)

    def eval_batches(self, n: int, batch_size: int, context: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`n` fixed (inputs, targets) batches of held-out windows, evenly spaced over the
        held-out tokens: the same on every peer and every call, no randomness involved."""
        check_positive("n", n)
        check_positive("batch_size", batch_size)
        check_positive("context", context)
        held_out = self.held_out
        self._check_long_enough(len(held_out), context, "held-out")
        total = n * batch_size
        last_start = len(held_out) - context - 1
        starts = torch.arange(total, dtype=torch.int64) * last_start // max(total - 1, 1)
        return [_windows(held_out, part, context) for part in starts.split(batch_size)]

    def _check_long_enough(self, length: int, context: int, part: str) -> None:
        if length < context + 1:
            raise ConfigError(
                f"corpus {self.source}: the {part} part has {length} tokens, too "
                f"few for a context of {context} (needs {context + 1})"
            )


def _windows(data: torch.Tensor, starts: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = data[starts[:, None] + torch.arange(context + 1)].long()
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def _bytes_to_tensor(data: bytes) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
