"""transformers models in pipeline swarms (models/staged.py): the stages of a tiny model of each
family a pipeline cuts (the LLaMA family; Granite, Cohere and Gemma 2/3, whose forward scales
outside its modules; GPT-2, with learned positions), run one after another, give the whole
model's loss and gradients; a tied LM head is one parameter of stage 0; the export of a
non-LLaMA family loads in transformers; an architecture a pipeline cannot cut is a one-line
error at `swarm create`. (Real daemons: the `slow` test at the end.)"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import trio

from meshtrain.errors import ConfigError
from meshtrain.models.sources import HFCausalLM, build_model
from meshtrain.models.staged import PIPELINE_HF_TYPES, pipeline_layers, staged
from meshtrain.node import cli
from meshtrain.node.spec.signed import SignedSpec
from meshtrain.node.spec.swarm import SwarmSpec
from meshtrain.node.stages import handover as stage_handover
from meshtrain.node.stages.export import load_assembled
from meshtrain.node.stages.state import StageStates
from meshtrain.pipeline.stages import StageReplica, load_stage_states
from meshtrain.transport.identity import Identity

from .test_pipeline_export import pipeline_peer_dir
from .test_pipeline_swarm import pipeline_spec, stage_step, three_daemons, wait_for, weights_digest
from .tiny_hf import save_tiny_llama, train_bpe

VOCAB = 64


def tiny(tmp_path: Path, model_type: str = "llama", **overrides: object) -> str:
    """The spec value of a 4-layer `model_type` model saved into tmp_path (hidden 32, 2 heads)."""
    if model_type == "llama":
        return f"hf:{save_tiny_llama(tmp_path / 'llama', vocab_size=VOCAB, num_hidden_layers=4, **overrides)}"
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_type == "gpt2":  # models train with their dropout on (sources.py): compare the cut without it
        overrides = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, **overrides}
    config = AutoConfig.for_model(
        model_type,
        pad_token_id=0,  # some families' defaults point past a 64-token vocabulary
        bos_token_id=1,
        eos_token_id=2,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        **overrides,
    )
    torch.manual_seed(0)
    out = tmp_path / model_type
    AutoModelForCausalLM.from_config(config).save_pretrained(str(out))
    return f"hf:{out}"


GRANITE_SCALES = {
    "embedding_multiplier": 12.0,
    "logits_scaling": 0.25,
    "residual_multiplier": 0.22,
    "attention_multiplier": 0.0078125,
}
GEMMA_HEADS = {"head_dim": 16, "query_pre_attn_scalar": 16}
GEMMA3_LAYERS = {"layer_types": ["sliding_attention", "full_attention"] * 2}
MOE = {"num_local_experts": 4, "num_experts_per_tok": 2}
QWEN_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
DEEPSEEK_MOE = {
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
}


def batches(n: int, T: int = 12) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        seq = torch.randint(0, VOCAB, (3, T + 1), generator=g)
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def whole_loss(model: HFCausalLM, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The whole transformers model's loss on the pipeline's objective (every position's target)."""
    logits = model.inner(input_ids=x).logits
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def staged_run(value: str, n_stages: int, data) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Every microbatch through stages 0, 1, ..., S-1 and the head, then back: the losses and the
    mean gradient by parameter name (as a pipeline iteration sums them)."""
    replicas = [StageReplica(build_model(value, vocab_size=VOCAB, seed=0), n_stages, s) for s in range(n_stages)]
    losses, total = [], {}
    for x, y in data:
        tapes = [replicas[0].embed(x)]
        for r in replicas[1:]:
            tapes.append(r.forward(tapes[-1].output.detach()))
        loss, grad, head_grads = replicas[0].head(tapes[-1].output.detach(), y)
        losses.append(loss)
        parts = [(replicas[0], head_grads)]
        for r, tape in reversed(list(zip(replicas, tapes, strict=True))):
            grad, grads = r.backward(tape, grad)
            parts.append((r, grads))
        assert grad is None  # stage 0's embedding has no previous hop
        for r, grads in parts:
            for name, g in r.grads_by_name(grads).items():
                total[name] = total.get(name, 0) + g / len(data)
    return losses, total


@pytest.mark.parametrize(
    "model_type,n_stages,overrides",
    [
        ("llama", 2, {}),
        ("llama", 3, {}),
        ("llama", 3, {"tie_word_embeddings": True}),
        ("qwen2", 3, {}),
        ("mistral", 2, {"sliding_window": 4}),  # a window shorter than the sequence: masks must match
        # the rest of the family: q/k norms (qwen3, olmo2), a scaled embedding and (1 + w) norms
        # (gemma), fused qkv and partial rotary (phi3, glm, stablelm), layers without rope
        # (smollm3), parameter-free and biased LayerNorms (olmo, starcoder2)
        ("qwen3", 3, {}),
        ("gemma", 3, {}),
        ("phi3", 3, {}),
        ("glm", 2, {}),
        ("smollm3", 3, {}),
        ("olmo", 2, {}),
        ("olmo2", 3, {}),
        ("starcoder2", 3, {"sliding_window": 4}),
        ("stablelm", 2, {}),
        # families whose forward scales outside the modules, each scale far from 1 so that a
        # stage 0 that missed one would show: Granite's embedding and logits multipliers (its
        # residual and attention multipliers act inside the layers), Cohere's logit scale, Gemma
        # 2/3's final logit soft-capping (at 0.1 it bends logits of this size), with their
        # alternating sliding-window layers and, in Gemma 3, per-layer-type rotary embeddings
        ("granite", 3, GRANITE_SCALES),
        ("cohere", 2, {"logit_scale": 8.0}),
        ("gemma2", 3, {"sliding_window": 4, "final_logit_softcapping": 0.1, **GEMMA_HEADS}),
        ("gemma3_text", 3, {"sliding_window": 4, "final_logit_softcapping": 0.1, **GEMMA_HEADS, **GEMMA3_LAYERS}),
        # GPT-2: learned absolute positions added at stage 0, blocks without rotary embeddings
        ("gpt2", 3, {}),
        ("gpt2", 2, {"tie_word_embeddings": False}),
        # mixtures of experts (top-2 of 4 experts): a shared expert (qwen2_moe), latent attention
        # and a dense first layer (deepseek_v3), attention sinks with sliding windows (gpt_oss),
        # Granite's scales around experts (granitemoe)
        ("mixtral", 3, MOE),
        ("qwen2_moe", 2, {**QWEN_MOE, "shared_expert_intermediate_size": 32}),
        ("olmoe", 2, QWEN_MOE),
        ("deepseek_v3", 3, DEEPSEEK_MOE),
        ("gpt_oss", 2, {**MOE, "head_dim": 16, "sliding_window": 4, **GEMMA3_LAYERS}),
        ("granitemoe", 2, {**GRANITE_SCALES, **MOE}),
    ],
)
def test_stages_in_sequence_equal_the_whole_hf_model_loss_and_gradients(tmp_path, model_type, n_stages, overrides):
    value = tiny(tmp_path, model_type, **overrides)
    data = batches(2)
    whole = build_model(value, vocab_size=VOCAB, seed=0)
    whole.zero_grad(set_to_none=True)
    want_losses = []
    for x, y in data:
        loss = whole_loss(whole, x, y)
        want_losses.append(loss.item())
        (loss / len(data)).backward()
    want = {n: p.grad for n, p in whole.named_parameters()}
    losses, got = staged_run(value, n_stages, data)
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(losses, want_losses, strict=True)), (
        losses,
        want_losses,
    )
    assert set(got) == set(want)
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=1e-4, atol=1e-6), name


def test_a_tied_lm_head_is_one_parameter_of_stage_0_and_the_cut_covers_every_parameter_once(tmp_path):
    model = build_model(tiny(tmp_path, tie_word_embeddings=True), vocab_size=VOCAB, seed=0)
    assert model.inner.lm_head.weight is model.inner.model.embed_tokens.weight
    stages = staged(model).stages(3)
    names = [n for st in stages for n in st.parameter_names]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters()) and len(set(names)) == len(names)
    assert stages[0].parameter_names == ("inner.model.embed_tokens.weight", "inner.model.norm.weight")
    assert [st.blocks for st in stages[1:]] == [range(0, 2), range(2, 4)]
    assert stages[2].parameter_names and all(
        n.startswith(("inner.model.layers.2.", "inner.model.layers.3.")) for n in stages[2].parameter_names
    )


def test_the_stage_cut_of_an_hf_pipeline_swarm_is_pinned_at_swarm_create(tmp_path):
    value = tiny(tmp_path)
    assert pipeline_layers(value) == 4
    spec = SwarmSpec(model=value, pipeline="skippipe", stages=3)
    signed = SignedSpec.create(spec, Identity.load_or_create(tmp_path / "id"))
    assert signed.spec.pipeline.stage_cut == "0-1,2-3" and signed.spec.model.digest
    fresh = f"hf-config:{value[3:]}/config.json"  # the same architecture with fresh weights
    assert pipeline_layers(fresh) == 4
    assert [st.blocks for st in staged(build_model(fresh, vocab_size=VOCAB, seed=0)).stages(3)[1:]] == [
        range(0, 2),
        range(2, 4),
    ]
    with pytest.raises(ConfigError, match="2..5 stages"):
        SignedSpec.create(SwarmSpec(model=value, pipeline="skippipe", stages=6), Identity.load_or_create(tmp_path))
    with pytest.raises(ConfigError, match="covers blocks 0..2"):
        SignedSpec.create(
            SwarmSpec(model=value, pipeline="skippipe", stages=3, stage_cut="0,1-2"), Identity.load_or_create(tmp_path)
        )


def test_a_gpt2_cut_keeps_its_learned_positions_on_stage_0_and_its_layer_count_is_n_layer(tmp_path):
    value = tiny(tmp_path, "gpt2")
    config = json.loads((Path(value[3:]) / "config.json").read_text())
    assert "num_hidden_layers" not in config and pipeline_layers(value) == config["n_layer"] == 4
    stages = staged(build_model(value, vocab_size=VOCAB, seed=0)).stages(3)
    assert stages[0].parameter_names == (
        "inner.transformer.wte.weight",  # the tied LM head's weight too
        "inner.transformer.wpe.weight",
        "inner.transformer.ln_f.weight",
        "inner.transformer.ln_f.bias",
    )
    assert [st.blocks for st in stages[1:]] == [range(0, 2), range(2, 4)]


@pytest.mark.parametrize(
    "model_type,overrides",
    [
        ("gemma2", {"final_logit_softcapping": 0.1, **GEMMA_HEADS}),
        ("gpt2", {}),
        ("qwen2_moe", {**QWEN_MOE, "shared_expert_intermediate_size": 32}),
    ],
)
def test_the_export_of_a_scaled_or_gpt2_pipeline_is_a_model_transformers_loads_with_the_stages_logits(
    tmp_path, model_type, overrides, capsys
):
    """A data dir holding every stage of a 3-stage hf-config: swarm (Gemma 2: soft-capped logits
    and a scaled embedding; GPT-2: learned positions; Qwen2-MoE: experts that transformers 5 holds
    fused and writes one per tensor) exports, without a node, a model that
    `AutoModelForCausalLM.from_pretrained` loads and that gives the stages' logits; `meshtrain
    sample`'s assembly (`load_assembled`) reads the same model back."""
    from transformers import AutoModelForCausalLM

    config = f"hf-config:{tiny(tmp_path, model_type, **overrides)[3:]}/config.json"
    spec = SwarmSpec(model=config, pipeline="skippipe", stages=3, batch_size=4, microbatches=2, eval_every=0)
    trainers = pipeline_peer_dir(tmp_path / "d", spec, [0, 1, 2])
    assert cli.main(["export", "--data-dir", str(tmp_path / "d"), "--out", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    vocab = trainers[0].replica.staged.vocab_size
    model = build_model(config, vocab_size=vocab, seed=0)
    load_stage_states(model, [trainers[s].replica.stage_state() for s in range(3)])
    model.eval()  # an hf-config: model is built in training mode: GPT-2's dropout would act
    stages = staged(model).stages(3)
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    assert exported.config.model_type == model_type
    x = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = stages[0].module["head"](stages[2].module(stages[1].module(stages[0].module["embed"](x)))).logits
        got = exported(input_ids=x).logits
        assembled = load_assembled(tmp_path / "d").model.inner(input_ids=x).logits
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert torch.allclose(assembled, want, atol=1e-5), (assembled - want).abs().max()


def test_an_unsupported_hf_architecture_is_a_one_line_error_at_swarm_create(tmp_path, capsys):
    from transformers import BloomConfig, BloomForCausalLM

    BloomForCausalLM(BloomConfig(n_layer=2, hidden_size=32, n_head=2, vocab_size=VOCAB)).save_pretrained(
        tmp_path / "bloom"
    )
    capsys.readouterr()  # save_pretrained's progress bar
    bloom = f"hf:{tmp_path / 'bloom'}"
    argv = ["swarm", "create", "--model", bloom, "--tokenizer", bloom, "--pipeline", "skippipe", "--stages", "2"]
    rc = cli.main([*argv, "--data-dir", str(tmp_path / "d")])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and "\n" not in err and "Traceback" not in err, err
    assert "bloom" in err and all(t in err for t in PIPELINE_HF_TYPES) and "gpt-tiny" in err, err
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "bloom", "n_layer": 2}))
    with pytest.raises(ConfigError, match="llama, mistral, qwen2, qwen3"):
        pipeline_layers(f"hf-config:{config}")
    with pytest.raises(ConfigError, match="transformers causal LM"):
        SwarmSpec(model="py:mymod:make", pipeline="skippipe", stages=2).check()


def test_a_mixture_of_experts_asking_for_its_routers_aux_loss_is_refused_in_one_line(tmp_path, capsys):
    """A pipeline does not add the routers' load-balancing loss across stages: a config that asks
    for it is refused at swarm create and when a stage is built, not trained on another objective."""
    value = tiny(tmp_path, "mixtral", output_router_logits=True, **MOE)
    capsys.readouterr()
    argv = ["swarm", "create", "--model", value, "--tokenizer", value, "--pipeline", "skippipe", "--stages", "2"]
    rc = cli.main([*argv, "--data-dir", str(tmp_path / "d")])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and "\n" not in err and "Traceback" not in err, err
    assert "output_router_logits" in err and "false" in err, err
    with pytest.raises(ConfigError, match="load-balancing"):
        staged(build_model(value, vocab_size=VOCAB, seed=0))


@pytest.mark.slow
async def test_a_pipeline_swarm_of_daemons_trains_an_hf_llama_and_exports_a_model_transformers_loads(
    tmp_path, monkeypatch, capsys
):
    """Three daemons train a 2-layer LLaMA (hf:, with its BPE tokenizer) in two stages: two
    origins on stage 0 (embedding + norm + LM head), one peer on stage 1 (both decoder layers).
    The two replicas of stage 0 publish bit-identical weights at every step they share;
    `meshtrain export` on the stage-1 peer assembles the model, and
    `AutoModelForCausalLM.from_pretrained(out)` gives the logits of the published stages run in
    sequence; `meshtrain sample` there continues a prompt with the model assembled the same way."""
    from transformers import AutoModelForCausalLM

    llama, bpe = save_tiny_llama(tmp_path / "llama"), train_bpe(tmp_path / "bpe")
    published: dict[tuple[int, int], dict[str, dict[str, torch.Tensor]]] = {}  # (stage, step) -> peer -> weights
    offer = StageStates.publish

    def observe(self: StageStates, stage: int, step: int, state: dict) -> None:
        published.setdefault((stage, step), {})[self.host.peer_id] = state["weights"]
        offer(self, stage, step, state)

    monkeypatch.setattr(StageStates, "publish", observe)
    monkeypatch.setattr(stage_handover, "HANDOVER_WAIT", 0.0)  # all stop together
    spec = pipeline_spec(model=f"hf:{llama}", tokenizer=f"hf:{bpe}", context=16, steps=0)
    assert SignedSpec.create(spec, Identity.load_or_create(tmp_path / "a")).spec.pipeline.stage_cut == "0-1"
    out = tmp_path / "export"
    async with three_daemons(tmp_path, spec, timeout=90) as (nodes, _):
        await wait_for(lambda: all(stage_step(n)[1] >= 3 for n in nodes.values()))
        (later,) = [name for name, n in nodes.items() if stage_step(n)[0] == 1]
        argv = ["export", "--data-dir", str(tmp_path / later), "--out", str(out)]
        rc = [await trio.to_thread.run_sync(cli.main, argv)]
        capsys.readouterr()
        argv = ["sample", "--data-dir", str(tmp_path / later), "--prompt", "The ", "--max-new-tokens", "5"]
        rc.append(await trio.to_thread.run_sync(cli.main, argv))  # the same assembly, read back
        sampled = capsys.readouterr()
        for node in nodes.values():
            node.stop()
    assert rc == [0, 0] and sampled.out.startswith("The "), sampled
    info = json.loads((out / "meshtrain_export.json").read_text())
    step = info["step"]
    assert info["steps_agree"] and step >= 3 and [s["source"] for s in info["stages"]] == ["replicas", "own"], info
    replicas = published[(0, step)]
    assert len(replicas) == 2, replicas.keys()
    assert len({weights_digest(w) for w in replicas.values()}) == 1  # the replicas of stage 0 agree, bit for bit
    # The stages as published, run in sequence, against the export as transformers loads it.
    model = build_model(spec.model.source, vocab_size=300, seed=0)
    load_stage_states(model, [next(iter(replicas.values())), next(iter(published[(1, step)].values()))])
    stages = staged(model).stages(2)
    x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    exported = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    with torch.no_grad():
        want = stages[0].module["head"](stages[1].module(stages[0].module["embed"](x))).logits
        got = exported(input_ids=x).logits
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert not torch.equal(
        exported.model.embed_tokens.weight,
        build_model(spec.model.source, vocab_size=300, seed=0).inner.model.embed_tokens.weight,
    )
