"""Tokenizers: text to token ids and back, named by the swarm spec's `tokenizer` key.

Why: a swarm trains one vocabulary. Before this module the only tokenisation was the corpus'
`Vocab` (characters or bytes); real models come with a subword tokenizer on disk. Every consumer
(the trainer's built-in corpus, the data pipeline, `meshtrain sample`) goes through one small
protocol, `Tokenizer`:

    encode(text) -> list[int]     no special tokens added (no BOS); the data pipeline puts
                                  `eos_id` between documents when it has one
    decode(ids) -> str
    vocab_size: int               ids are in [0, vocab_size) (for HF: the base vocabulary plus
                                  added tokens, `len(tokenizer)`)
    digest: str                   what the spec pins (`tokenizer_digest`): equal digests mean
                                  equal tokenisation
    eos_id: int | None            the end-of-text id, or None (chars, bytes)
    name: str                     the spec value it was loaded from

Spec values (`load_tokenizer`):

    chars        the sorted set of the training text's characters (today's default for the
                 built-in model). Its alphabet is a function of the data, so its digest names
                 the kind only: the dataset's digest pins the data.
    bytes        the 256 UTF-8 byte values; the same for every text.
    hf:<path>    a Hugging Face tokenizer on disk, never downloaded: a directory holding a
                 `tokenizer_config.json` is read with `transformers.AutoTokenizer` (fast or
                 sentencepiece); a directory with only a `tokenizer.json`, or the path of such a
                 JSON file, is read with the `tokenizers` library.

Digest (`tokenizer_digest`): chars and bytes hash their kind; hf: hashes the bytes of the
tokenizer files found (the names in `TOKENIZER_FILES`, in sorted order, each with its name), so
a joining peer compares its local copy with the swarm's without loading it. Files outside that
list (model weights in the same directory) do not count.

Failures: a missing path, a directory with no tokenizer files, an unreadable file, a character
outside a chars alphabet: `ConfigError`, one line. `transformers` and `tokenizers` are imported
only for hf: tokenizers.

Not here: dataset reading and packing (meshtrain/data/), model loading (models/sources.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import blake3

from meshtrain.errors import ConfigError

# Files that define a Hugging Face tokenizer (what `save_pretrained` writes, for the fast,
# sentencepiece and WordPiece/BPE-file flavours). Their bytes are the hf: digest.
TOKENIZER_FILES = (
    "added_tokens.json",
    "merges.txt",
    "sentencepiece.bpe.model",
    "special_tokens_map.json",
    "spiece.model",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
)
# End-of-text spellings looked up in a bare tokenizer.json (no config naming its eos token).
EOS_SPELLINGS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
_DOMAIN = b"meshtrain/tokenizer/v1\n"


@runtime_checkable
class Tokenizer(Protocol):
    """What every tokenizer offers (module docstring)."""

    @property
    def name(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def digest(self) -> str: ...

    @property
    def eos_id(self) -> int | None: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def _kind_digest(kind: str) -> str:
    return blake3.blake3(_DOMAIN + kind.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes: ids 0..255."""

    name: str = "bytes"
    vocab_size: int = 256
    eos_id: int | None = None

    @property
    def digest(self) -> str:
        return _kind_digest("bytes")

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class CharTokenizer:
    """A character alphabet: id i is `chars[i]` (sorted, as `Vocab.from_text`)."""

    chars: str
    name: str = "chars"
    eos_id: int | None = None
    _index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {c: i for i, c in enumerate(self.chars)})

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    @property
    def digest(self) -> str:
        return _kind_digest("chars")

    def encode(self, text: str) -> list[int]:
        try:
            return [self._index[c] for c in text]
        except KeyError as e:
            raise ConfigError(
                f"character {e.args[0]!r} is not in this chars tokenizer's alphabet "
                f"(the training text's characters); use tokenizer bytes or hf:<dir>"
            ) from None

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.chars[int(i)] for i in ids)


@dataclass(frozen=True)
class HFTokenizer:
    """A Hugging Face tokenizer from disk (`transformers` or `tokenizers` backend).

    name: the spec value ("hf:<path>"). backend: the loaded tokenizer object.
    """

    name: str
    backend: Any = field(repr=False)
    digest: str
    vocab_size: int
    eos_id: int | None

    @property
    def is_transformers(self) -> bool:
        """True for a `transformers` tokenizer (save_pretrained-able), False for a bare
        `tokenizers.Tokenizer`."""
        return not _is_bare(self.backend)

    def encode(self, text: str) -> list[int]:
        backend = self.backend
        if getattr(backend, "is_fast", False):  # the same Rust tokenizer, without transformers' length warning
            backend = backend.backend_tokenizer
        if _is_bare(backend):
            return list(backend.encode(text, add_special_tokens=False).ids)
        return list(backend.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.backend.decode([int(i) for i in ids], skip_special_tokens=False))


def _is_bare(backend: Any) -> bool:
    return type(backend).__module__.startswith("tokenizers")


# -- spec values -------------------------------------------------------------------------------


def check_tokenizer_name(value: str) -> str:
    """Validate a spec `tokenizer` value's form (not the files); ValueError says what is allowed."""
    if value in ("chars", "bytes") or (value.startswith("hf:") and len(value) > 3):
        return value
    raise ValueError("must be chars, bytes or hf:<directory or tokenizer.json>")


def _hf_path(name: str) -> Path:
    path = Path(name[3:]).expanduser()
    if not path.exists():
        raise ConfigError(
            f"tokenizer {name}: {path} does not exist on this machine (every peer needs "
            f"the same tokenizer files at that path)"
        )
    return path


def _tokenizer_files(name: str) -> list[Path]:
    path = _hf_path(name)
    if path.is_file():
        return [path]
    found = [path / f for f in TOKENIZER_FILES if (path / f).is_file()]
    if not found:
        raise ConfigError(f"tokenizer {name}: {path} holds no tokenizer files (one of {', '.join(TOKENIZER_FILES)})")
    return found


def tokenizer_digest(name: str) -> str:
    """The digest the spec pins for tokenizer `name` (module docstring), from files alone."""
    try:
        check_tokenizer_name(name)
    except ValueError as e:
        raise ConfigError(f"tokenizer {name!r}: {e}") from None
    if not name.startswith("hf:"):
        return _kind_digest(name)
    h = blake3.blake3(_DOMAIN + b"hf")
    for f in _tokenizer_files(name):
        try:
            data = f.read_bytes()
        except OSError as e:
            raise ConfigError(f"tokenizer {name}: cannot read {f}: {e.strerror or e}") from None
        h.update(f.name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()[:32]


def load_tokenizer(name: str, *, text: str | None = None) -> Tokenizer:
    """The tokenizer the spec value `name` names. `text`: the training text, which a chars
    tokenizer takes its alphabet from (required for chars, ignored otherwise)."""
    if name == "bytes":
        return ByteTokenizer()
    if name == "chars":
        if text is None:
            raise ConfigError("tokenizer chars takes its alphabet from the training text; none was given")
        return CharTokenizer.from_text(text)
    digest = tokenizer_digest(name)  # validates the name and the files
    path = _hf_path(name)
    if path.is_dir() and (path / "tokenizer_config.json").is_file():
        try:
            import transformers
        except ImportError:
            raise ConfigError(f"tokenizer {name} needs the `transformers` package: pip install transformers") from None
        try:
            backend = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(
                f"tokenizer {name}: cannot load it with AutoTokenizer: {str(e).splitlines()[0][:300]}"
            ) from None
        eos = backend.eos_token_id
        return HFTokenizer(name, backend, digest, len(backend), eos if isinstance(eos, int) else None)
    json_file = path if path.is_file() else path / "tokenizer.json"
    if not json_file.is_file():
        raise ConfigError(
            f"tokenizer {name}: {path} has neither a tokenizer_config.json (transformers) "
            f"nor a tokenizer.json (tokenizers)"
        )
    try:
        import tokenizers
    except ImportError:
        raise ConfigError(f"tokenizer {name} needs the `tokenizers` package: pip install tokenizers") from None
    try:
        fast = tokenizers.Tokenizer.from_file(str(json_file))
    except Exception as e:  # noqa: BLE001 — the Rust binding raises plain Exception on a bad file
        raise ConfigError(
            f"tokenizer {name}: {json_file} is not a tokenizers JSON file: {str(e).splitlines()[0][:300]}"
        ) from None
    eos = next((i for s in EOS_SPELLINGS if (i := fast.token_to_id(s)) is not None), None)
    return HFTokenizer(name, fast, digest, fast.get_vocab_size(with_added_tokens=True), eos)
