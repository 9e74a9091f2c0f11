"""The built-in GPT and corpus: seed-determinism, block orders, stage cuts, data assignment,
held-out split, file errors, and a short training run that must learn."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from meshtrain.errors import ConfigError
from meshtrain.models import GPT, Corpus, GPTConfig, ModelInputError, Vocab


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # These models are too small for intra-op parallelism to pay; on a shared 2-core machine a
    # second OpenMP thread mostly spins (measured: 8 s for this file with 2 threads, 2.4 s with 1).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return Corpus.default()


def _same_batch(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return all(torch.equal(u, v) for u, v in zip(a, b, strict=True))


# -- model ------------------------------------------------------------------------------------


def test_same_seed_builds_bit_identical_weights_other_seed_differs_global_rng_untouched():
    config = GPTConfig.tiny(103)
    rng_before = torch.get_rng_state()
    a, b, other = GPT(config, seed=7), GPT(config, seed=7), GPT(config, seed=8)
    assert torch.equal(torch.get_rng_state(), rng_before)
    for (name, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(p, q), name
    assert all(
        not torch.equal(p, r)
        for (n, p), (_, r) in zip(a.named_parameters(), other.named_parameters(), strict=True)
        if n.endswith("weight") and p.dim() > 1
    )


def test_head_is_tied_to_token_embedding_unless_disabled():
    model = GPT(GPTConfig.tiny(50))
    assert model.head.lm_head.weight is model.embed.token.weight
    untied = GPT(GPTConfig(50, n_layer=1, n_head=1, d_model=16, context=8, tie_embeddings=False))
    assert untied.head.lm_head.weight is not untied.embed.token.weight


def test_parameter_count_formula_matches_built_models_and_large_preset_is_25m():
    for config in (
        GPTConfig.tiny(103),
        GPTConfig.small(103),
        GPTConfig(77, n_layer=3, n_head=2, d_model=24, context=10, tie_embeddings=False),
    ):
        assert GPT(config).num_parameters() == config.num_parameters()
    assert GPTConfig.large().num_parameters() >= 25_000_000
    assert GPTConfig.for_params(1_000_000).num_parameters() >= 1_000_000


def test_forward_shapes_and_initial_loss_is_about_log_vocab(corpus):
    model = GPT(GPTConfig.small(corpus.vocab_size), seed=0)
    x, y = corpus.batch(8, 32, seed=0, peer="p", step=0)
    logits, loss = model(x)
    assert logits.shape == (8, 32, corpus.vocab_size) and loss is None
    out = model(x, y)
    # not exactly ln V: with tied embeddings each position's logit for its own input token
    # starts slightly high (|e|^2 / std(e) ~ 0.02 d), worth ~0.15 nats here
    assert out.loss is not None and abs(out.loss.item() - math.log(corpus.vocab_size)) < 0.25
    assert model(x[:, :5]).logits.shape == (8, 5, corpus.vocab_size)


def test_full_block_order_equals_default_forward_and_skipping_changes_it(corpus):
    model = GPT(GPTConfig.small(corpus.vocab_size), seed=3)
    x, y = corpus.batch(2, 32, seed=0, peer=0, step=0)
    full = model(x, y)
    same = model(x, y, block_order=[0, 1, 2, 3])
    assert torch.equal(full.logits, same.logits) and torch.equal(full.loss, same.loss)
    half = model(x, y, block_order=[0, 2])  # inference with omission
    swapped = model(x, y, block_order=[0, 2, 1, 3])  # SkipPipe swap
    assert not torch.allclose(full.logits, half.logits)
    assert not torch.allclose(full.logits, swapped.logits)
    assert model(x, block_order=[]).logits.shape == full.logits.shape
    assert math.isfinite(model.evaluate([(x, y)], block_order=[1, 3]))


def test_bad_forward_inputs_raise_model_input_error():
    model = GPT(GPTConfig.tiny(10))
    x = torch.zeros(1, 4, dtype=torch.long)
    for order in ([2], [-1], [0.5]):
        with pytest.raises(ModelInputError):
            model(x, block_order=order)
    with pytest.raises(ModelInputError, match="context"):
        model(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ModelInputError, match="token ids"):
        model(torch.full((1, 4), 10))


@pytest.mark.parametrize("n_stages", [2, 3, 4, 5])
def test_stage_split_covers_every_parameter_exactly_once_and_composes_to_forward(corpus, n_stages):
    model = GPT(GPTConfig.small(corpus.vocab_size), seed=1)
    stages = model.stages(n_stages)
    assert [s.index for s in stages] == list(range(n_stages))
    names = [n for s in stages for n in s.parameter_names]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    ids = [id(p) for s in stages for p in s.module.parameters()]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    assert [i for s in stages[1:] for i in s.blocks] == list(range(model.config.n_layer))
    params = dict(model.named_parameters())
    for s in stages:
        assert [id(p) for p in s.module.parameters()] == [id(params[n]) for n in s.parameter_names]
    # stage 0 embeds, the block stages run in turn, stage 0 computes the loss
    x, y = corpus.batch(2, 32, seed=0, peer=0, step=1)
    h = stages[0].module["embed"](x)
    for s in stages[1:]:
        h = s.module(h)
    assert torch.equal(stages[0].module["head"](h, y).loss, model(x, y).loss)


def test_stage_count_out_of_range_is_a_config_error():
    model = GPT(GPTConfig.tiny(10))
    for n in (1, 4):
        with pytest.raises(ConfigError):
            model.stages(n)


def test_config_validates_and_round_trips_through_a_dict():
    with pytest.raises(ConfigError, match="divisible"):
        GPTConfig(10, n_head=3, d_model=64)
    with pytest.raises(ConfigError):
        GPTConfig(0)
    config = GPTConfig.small(103)
    assert GPTConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ConfigError, match="unknown"):
        GPTConfig.from_dict({**config.to_dict(), "n_layers": 3})


# -- corpus -----------------------------------------------------------------------------------


def test_batch_is_a_pure_function_of_seed_peer_step(corpus):
    a = corpus.batch(4, 16, seed=1, peer="A", step=10)
    assert _same_batch(a, corpus.batch(4, 16, seed=1, peer="A", step=10))
    assert _same_batch(a, Corpus.default().batch(4, 16, seed=1, peer="A", step=10))  # restart
    for other in (dict(seed=1, peer="B", step=10), dict(seed=1, peer="A", step=11), dict(seed=2, peer="A", step=10)):
        assert not torch.equal(a[0], corpus.batch(4, 16, **other)[0]), other
    assert not torch.equal(a[0], corpus.batch(4, 16, seed=1, peer="A", step=10, microbatch=1)[0])
    assert _same_batch(corpus.batch(2, 8, seed=0, peer=3, step=0), corpus.batch(2, 8, seed=0, peer="3", step=0))
    x, y = a
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_batch_does_not_touch_global_rng(corpus):
    before = torch.get_rng_state()
    corpus.batch(4, 16, seed=0, peer=0, step=0)
    corpus.eval_batches(2, 4, 16)
    assert torch.equal(torch.get_rng_state(), before)


def test_held_out_is_a_disjoint_tail_and_batches_stay_on_their_side(corpus):
    n = len(corpus.tokens)
    assert corpus.held_out_start == int(n * 0.9)
    assert torch.equal(torch.cat([corpus.train, corpus.held_out]), corpus.tokens)
    train_text = corpus.vocab.decode(corpus.train)
    held_out_text = corpus.vocab.decode(corpus.held_out)
    x, y = corpus.batch(8, 32, seed=5, peer="p", step=3)
    for row, last in zip(x, y[:, -1], strict=True):
        assert corpus.vocab.decode(torch.cat([row, last[None]])) in train_text
    evals = corpus.eval_batches(3, 4, 32)
    assert len(evals) == 3 and all(ex.shape == (4, 32) for ex, _ in evals)
    assert all(_same_batch(u, v) for u, v in zip(evals, corpus.eval_batches(3, 4, 32), strict=True))
    for ex, ey in evals:
        for row, last in zip(ex, ey[:, -1], strict=True):
            assert corpus.vocab.decode(torch.cat([row, last[None]])) in held_out_text
    # evenly spaced: the first and the last held-out window are both used
    assert torch.equal(evals[0][0][0], corpus.held_out[:32].long())
    assert torch.equal(evals[-1][1][-1], corpus.held_out[-32:].long())


def test_vocab_is_stable_and_bytes_vocab_does_not_depend_on_text(corpus):
    again = Corpus.default()
    assert again.vocab == corpus.vocab and again.digest == corpus.digest
    assert corpus.vocab.chars == "".join(sorted(set(corpus.vocab.chars)))
    assert sys.version in corpus.source
    as_bytes = Corpus.default(vocab="bytes")
    assert as_bytes.vocab_size == 256 and as_bytes.digest != corpus.digest
    other = Corpus.from_text("héllo wörld " * 20, vocab="bytes", context=8)
    assert other.vocab == as_bytes.vocab
    assert other.vocab.decode(other.tokens) == "héllo wörld " * 20
    assert corpus.vocab.decode(corpus.vocab.encode("def f(x): pass")) == "def f(x): pass"
    with pytest.raises(ConfigError, match="bytes"):
        corpus.vocab.encode("日本")
    assert Vocab.of_bytes().size == 256


def test_unusable_corpus_file_is_a_config_error_that_says_why(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        Corpus.from_file(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ConfigError, match="empty"):
        Corpus.from_file(tmp_path / "empty.txt")
    (tmp_path / "short.txt").write_text("too short for a context of 32")
    with pytest.raises(ConfigError, match="too short"):
        Corpus.from_file(tmp_path / "short.txt")
    with pytest.raises(ConfigError, match="cannot read"):
        Corpus.from_file(tmp_path)
    (tmp_path / "latin1.bin").write_bytes("café ".encode("latin-1") * 200)
    with pytest.raises(ConfigError, match="UTF-8"):
        Corpus.from_file(tmp_path / "latin1.bin")
    raw = Corpus.from_file(tmp_path / "latin1.bin", vocab="bytes")
    assert raw.vocab_size == 256 and len(raw.tokens) == 1000
    ok = Corpus.from_file(tmp_path / "short.txt", context=2)
    with pytest.raises(ConfigError, match="too few"):
        ok.batch(1, 30, seed=0, peer=0, step=0)


# -- learning ---------------------------------------------------------------------------------


def test_tiny_model_learns_in_100_steps(corpus):
    model = GPT(GPTConfig.tiny(corpus.vocab_size), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    evals = corpus.eval_batches(2, 16, 32)
    before = model.evaluate(evals)
    for step in range(100):
        x, y = corpus.batch(16, 32, seed=0, peer=0, step=step)
        loss = model(x, y).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    after = model.evaluate(evals)
    assert after < before - 0.8, (before, after)


def test_greedy_generation_is_deterministic_and_respects_the_context():
    model = GPT(GPTConfig.tiny(20), seed=2)
    prompt = torch.zeros(2, 30, dtype=torch.long)
    out = model.generate(prompt, 5, temperature=0)
    assert out.shape == (2, 35) and torch.equal(out[:, :30], prompt)
    assert torch.equal(out, model.generate(prompt, 5, temperature=0))
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    assert torch.equal(model.generate(prompt, 4, generator=g1), model.generate(prompt, 4, generator=g2))
