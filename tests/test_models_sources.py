"""Model sources, tokenizers and the digests a swarm pins: a pretrained tiny LLaMA loads as is,
fresh configs and py: factories build the same θ0 on every peer, the context comes from the
model or the spec with no cap, and a local copy that differs from the swarm's is refused with a
message naming what differs."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshtrain.errors import ConfigError
from meshtrain.models import Corpus
from meshtrain.models.sources import (
    HFCausalLM,
    build_model,
    check_local_copy,
    model_digest,
    next_token_logits,
    parse_model_source,
    resolve_context,
)
from meshtrain.models.tokenizers import ByteTokenizer, Tokenizer, load_tokenizer, tokenizer_digest
from meshtrain.node.spec.swarm import SwarmSpec, parse_spec

from .tiny_hf import BPE_VOCAB, FACTORY, corpus_text, save_tiny_llama, train_bpe

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("hf")
    return save_tiny_llama(root / "llama"), train_bpe(root / "bpe")


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


# -- tokenizers --------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_bytes_tokenizer_round_trips_any_text(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_hf_tokenizers_from_a_directory_and_a_bare_json_agree(hf_dirs, tmp_path):
    _, bpe = hf_dirs
    bare = train_bpe(tmp_path / "bare", transformers_dir=False)
    text = corpus_text()[:2000]
    for name in (f"hf:{bpe}", f"hf:{bare}", f"hf:{bare / 'tokenizer.json'}"):
        tok = load_tokenizer(name)
        assert isinstance(tok, Tokenizer)
        assert tok.vocab_size == BPE_VOCAB and tok.eos_id == 0
        ids = tok.encode(text)
        assert len(ids) < len(text) and max(ids) < tok.vocab_size
        assert tok.decode(ids) == text
        assert tok.digest == tokenizer_digest(name)
    assert load_tokenizer(f"hf:{bpe}").encode(text) == load_tokenizer(f"hf:{bare}").encode(text)
    # A copy of the files has the digest; a change in any tokenizer file changes it.
    copy = tmp_path / "copy"
    shutil.copytree(bpe, copy)
    assert tokenizer_digest(f"hf:{copy}") == tokenizer_digest(f"hf:{bpe}")
    (copy / "tokenizer_config.json").write_text(
        (copy / "tokenizer_config.json").read_text().replace("<|endoftext|>", "</s>")
    )
    assert tokenizer_digest(f"hf:{copy}") != tokenizer_digest(f"hf:{bpe}")


def test_a_corpus_tokenised_with_a_bpe_pins_its_tokenizer(hf_dirs):
    tok = load_tokenizer(f"hf:{hf_dirs[1]}")
    corpus = Corpus.default(tok)
    assert corpus.vocab_size == BPE_VOCAB and int(corpus.tokens.max()) < BPE_VOCAB
    assert corpus.digest != Corpus.default("bytes").digest
    x, y = corpus.batch(2, 16, seed=0, peer="p", step=0)
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_tokenizer_mistakes_are_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    for name, match in (
        (f"hf:{tmp_path / 'none'}", "does not exist"),
        (f"hf:{tmp_path / 'empty'}", "no tokenizer"),
        ("sentencepiece", "must be chars, bytes or hf:"),
        ("chars", "alphabet"),
    ):
        with pytest.raises(ConfigError, match=match) as e:
            load_tokenizer(name)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="tokenizer"):
        parse_spec({"tokenizer": "words"})


# -- models ------------------------------------------------------------------------------------


def test_pretrained_hf_model_loads_its_weights_and_context(hf_dirs):
    llama, _ = hf_dirs
    model = build_model(f"hf:{llama}", vocab_size=BPE_VOCAB, seed=123)
    assert isinstance(model, HFCausalLM)
    # Built to train, as every source's model is (from_pretrained alone gives eval mode: no dropout).
    assert all(m.training for m in model.modules())
    assert all(m.training for m in build_model(f"hf-config:{llama / 'config.json'}", vocab_size=50, seed=0).modules())
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(llama))
    assert same({f"inner.{n}": p for n, p in params_of(reference).items()}, params_of(model))
    assert resolve_context(model, 0) == 64 and resolve_context(model, 16) == 16
    with pytest.raises(ConfigError, match="context 128 is longer than .* allows \\(64 positions\\)"):
        resolve_context(model, 128, f"hf:{llama}")
    x = torch.randint(0, BPE_VOCAB, (2, 8))
    assert torch.isfinite(model(x, x)) and next_token_logits(model, x).shape == (2, BPE_VOCAB)
    with pytest.raises(ConfigError, match="embeds 300 token ids but the tokenizer has 301"):
        build_model(f"hf:{llama}", vocab_size=BPE_VOCAB + 1, seed=0)
    with pytest.raises(ConfigError, match="hf-config:"):
        build_model(f"hf:{llama / 'config.json'}", vocab_size=BPE_VOCAB, seed=0)


def test_a_pretrained_model_needs_its_tokenizer_in_the_spec(hf_dirs):
    with pytest.raises(ConfigError, match="needs the tokenizer it was trained with"):
        parse_spec({"model": f"hf:{hf_dirs[0]}"})
    spec = parse_spec({"model": f"hf:{hf_dirs[0]}", "tokenizer": f"hf:{hf_dirs[1]}"})
    assert spec.model.context == 0 and spec.model.digest == ""


def test_fresh_config_builds_the_same_weights_from_the_same_seed(hf_dirs):
    config = hf_dirs[0] / "config.json"
    a, b = (build_model(f"hf-config:{config}", vocab_size=50, seed=7) for _ in range(2))
    c = build_model(f"hf-config:{config}", vocab_size=50, seed=8)
    assert same(params_of(a), params_of(b)) and not same(params_of(a), params_of(c))
    assert a.inner.config.vocab_size == 50 and resolve_context(a, 0) == 64
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    build_model(f"hf-config:{config}", vocab_size=50, seed=7)
    assert torch.equal(torch.rand(3), expected), "building a model must not move the caller's RNG"


def test_py_factory_from_a_file_and_from_a_module(tmp_path, monkeypatch):
    source = tmp_path / "mymodels.py"
    source.write_text(FACTORY)
    by_path = build_model(f"py:{source}:make", vocab_size=40, seed=3)
    monkeypatch.syspath_prepend(str(tmp_path))
    by_module = build_model("py:mymodels:make", vocab_size=40, seed=3)
    assert same(params_of(by_path), params_of(by_module))
    assert resolve_context(by_path, 0) == 16
    x = torch.randint(0, 40, (2, 5))
    assert torch.isfinite(by_path(x, x)) and next_token_logits(by_path, x).shape == (2, 40)
    assert model_digest(f"py:{source}:make") == model_digest("py:mymodels:make")
    pinned = model_digest("py:mymodels:make")
    assert pinned.startswith("source=") and model_digest("py:mymodels:not_a_model") != pinned
    source.write_text(FACTORY + "\n# changed\n")
    with pytest.raises(ConfigError, match="model: your py:mymodels:make differs from the swarm's \\(source digest"):
        check_local_copy("py:mymodels:make", "chars", model_pin=pinned, tokenizer_pin="")
    with pytest.raises(ConfigError, match="returned a int, not a torch.nn.Module"):
        build_model(f"py:{source}:not_a_model", vocab_size=40, seed=0)
    with pytest.raises(ConfigError, match="has no attribute missing"):
        build_model(f"py:{source}:missing", vocab_size=40, seed=0)
    with pytest.raises(ConfigError, match="cannot import"):
        build_model("py:no_such_module_here:make", vocab_size=40, seed=0)
    sys.modules.pop("mymodels", None)


def test_model_values_parse_or_say_what_is_allowed():
    assert parse_model_source("gpt-tiny").kind == "builtin"
    assert parse_model_source("py:a/b.py:make") == parse_model_source("py:a/b.py:make")
    assert parse_model_source("py:a/b.py:make").is_path and not parse_model_source("py:pkg.mod:make").is_path
    for bad in ("gpt-huge", "hf:", "py:make", "py:mod:not-an-identifier"):
        with pytest.raises(ValueError):
            parse_model_source(bad)
        with pytest.raises(ConfigError, match="model"):
            parse_spec({"model": bad})


def test_builtin_presets_take_the_spec_context():
    model = build_model("gpt-tiny", vocab_size=30, seed=0, context=48)
    assert resolve_context(model, 48) == 48 and resolve_context(build_model("gpt-tiny", vocab_size=30, seed=0), 0) == 32
    assert model_digest("gpt-tiny") != model_digest("gpt-small")


# -- pins --------------------------------------------------------------------------------------


def test_a_differing_local_copy_is_refused_naming_what_differs(hf_dirs, tmp_path):
    llama, bpe = hf_dirs
    pin_model, pin_tok = model_digest(f"hf:{llama}"), tokenizer_digest(f"hf:{bpe}")
    copy = tmp_path / "llama"
    shutil.copytree(llama, copy)
    check_local_copy(f"hf:{copy}", f"hf:{bpe}", model_pin=pin_model, tokenizer_pin=pin_tok)  # same content
    retrained = save_tiny_llama(tmp_path / "other-weights", seed=1)
    with pytest.raises(ConfigError, match=r"model: your hf:\S+ differs from the swarm's \(weights digest") as e:
        check_local_copy(f"hf:{retrained}", f"hf:{bpe}", model_pin=pin_model, tokenizer_pin=pin_tok)
    assert "\n" not in str(e.value)
    reshaped = save_tiny_llama(tmp_path / "other-config", rms_norm_eps=1e-5)
    with pytest.raises(ConfigError, match=r"\(config digest"):
        check_local_copy(f"hf:{reshaped}", f"hf:{bpe}", model_pin=pin_model, tokenizer_pin=pin_tok)
    other_bpe = train_bpe(tmp_path / "bpe-200", vocab_size=200)
    with pytest.raises(ConfigError, match=r"tokenizer: your hf:\S+ differs from the swarm's \(tokenizer digest"):
        check_local_copy(f"hf:{llama}", f"hf:{other_bpe}", model_pin=pin_model, tokenizer_pin=pin_tok)
    check_local_copy(f"hf:{retrained}", f"hf:{other_bpe}", model_pin="", tokenizer_pin="")  # unpinned spec


def test_signed_spec_pins_digests_at_create(tmp_path, hf_dirs):
    from meshtrain.node.spec.signed import SignedSpec
    from meshtrain.transport.identity import Identity

    spec = SwarmSpec(model=f"hf:{hf_dirs[0]}", tokenizer=f"hf:{hf_dirs[1]}")
    signed = SignedSpec.create(spec, Identity.load_or_create(tmp_path))
    assert signed.spec.model.digest == model_digest(spec.model.source)
    assert signed.spec.model.tokenizer_digest == tokenizer_digest(spec.model.tokenizer)
    again = SignedSpec.from_wire(signed.to_wire())
    assert again.swarm_id == signed.swarm_id and again.spec == signed.spec


def test_swarm_create_caps_the_context_of_an_hf_model_that_allows_more_and_says_so(hf_dirs, tmp_path):
    """Llama 3's 131,072 positions as the default context would OOM any GPU at once: `swarm
    create` pins CONTEXT_CAP instead (a model within the cap, or a context given, is left alone)."""
    import json
    import subprocess

    from meshtrain.models.sources import CONTEXT_CAP, capped_context
    from meshtrain.node.spec.signed import SignedSpec
    from meshtrain.transport.identity import Identity

    from .conftest import ROOT

    long = tmp_path / "long.json"
    long.write_text(
        json.dumps({**json.loads((hf_dirs[0] / "config.json").read_text()), "max_position_embeddings": 131072})
    )
    assert capped_context(f"hf-config:{long}") == (CONTEXT_CAP, 131072)
    assert capped_context(f"hf-config:{hf_dirs[0] / 'config.json'}") is None  # 64 positions: its own
    assert capped_context("gpt-tiny") is None
    me = Identity.load_or_create(tmp_path / "me")
    tok = f"hf:{hf_dirs[1]}"
    signed = SignedSpec.create(parse_spec({"model": f"hf-config:{long}", "tokenizer": tok}), me)
    assert signed.spec.model.context == CONTEXT_CAP == signed.signed["model"]["context"]
    chosen = SignedSpec.create(parse_spec({"model": f"hf-config:{long}", "tokenizer": tok, "context": 512}), me)
    assert chosen.spec.model.context == 512
    small = SignedSpec.create(parse_spec({"model": f"hf:{hf_dirs[0]}", "tokenizer": tok}), me)
    assert small.spec.model.context == 0
    r = subprocess.run(
        [sys.executable, "-m", "meshtrain.node.cli", "swarm", "create", "--data-dir", str(tmp_path / "c")]
        + ["--model", f"hf-config:{long}", "--tokenizer", tok],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert f"context {CONTEXT_CAP} tokens per sequence" in r.stderr and "allows 131072" in r.stderr, r.stderr
