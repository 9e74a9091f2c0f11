"""Getting the trained model out: `meshtrain export` and `meshtrain sample`.

What the swarm has trained is φ, the outer parameters every peer agrees on after a round
(`state["outer"]["outer_params"]` in a checkpoint, trainer.checkpoint_state), not this peer's
replica θ in between rounds. `load_trained(data_dir)` rebuilds the spec's model (node/trainer's
`build_model`: the same θ0 the swarm started from), loads the newest checkpoint's θ (for
buffers and anything not trained) and then writes φ over every trained parameter.

Export (`export_model`), into a new directory (written beside it, renamed into place once
complete, so a crash leaves no half export):

    hf: and hf-config: models   the Hugging Face model's own `save_pretrained` (config.json,
                                model.safetensors, or shards of at most 5 GB and
                                model.safetensors.index.json) and the tokenizer's (a bare tokenizers
                                tokenizer.json is wrapped in `PreTrainedTokenizerFast`), so
                                `AutoModelForCausalLM.from_pretrained(out)` and
                                `AutoTokenizer.from_pretrained(out)` load it
    built-in GPTs               model.safetensors (`huggingface_hub.save_torch_model`: the tied
                                embedding once; shards and model.safetensors.index.json past
                                5 GB, the Hub's layout) and config.json: {"meshtrain_model":
                                preset, "gpt_config": GPTConfig fields}; load with
                                `huggingface_hub.load_torch_model(GPT(GPTConfig(**gpt_config)), out)`
    py: models                  the same weights and config.json naming the factory and its
                                source digest (rebuild with the factory, then `load_torch_model`)

Every export also holds `meshtrain_export.json`: swarm id, step, round, model, tokenizer, their
digests and the context; and a chars or bytes tokenizer as `meshtrain_tokenizer.json`.
`write_export(trained, out, extra)` is that writer for any `Trained` (a pipeline swarm's assembled
model, node/stages/export.py, adds where each stage came from as `extra`).

Pipeline swarms. A pipeline peer's checkpoints hold its own stage only, so `load_trained` refuses
its data dir and says so; node/stages/export.py assembles the whole model from every stage
(through the running node) and writes it with `write_export`.

Sample (`sample`): greedy decoding by default, top-k sampling with a seeded generator with
`top_k > 0`; the prompt is cropped to the model's context as the text grows; stops at the
tokenizer's end-of-text id. No KV cache: it recomputes the window per token (fine for a look at
what the model learned, not a server).

Failures, one line each (ConfigError): a directory that is no node's data dir (no swarm.json),
a pipeline peer's data dir (above), one with no checkpoint yet, a model or tokenizer whose local files differ from the swarm's pins,
an export target that exists and is not empty, a checkpoint whose φ does not fit the model.

Not here: serving, quantisation, converting a built-in GPT to a transformers class.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from meshtrain.errors import ConfigError
from meshtrain.models.gpt import GPT
from meshtrain.models.sources import (
    HFCausalLM,
    check_local_copy,
    next_token_logits,
    resolve_context,
)
from meshtrain.models.tokenizers import (
    ByteTokenizer,
    CharTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
)
from meshtrain.node.spec.data_dir import CHECKPOINT_DIR, SPEC_FILE
from meshtrain.node.spec.signed import SignedSpec
from meshtrain.node.state.checkpoint import CheckpointStore
from meshtrain.node.trainer import build_model, load_data

EXPORT_INFO = "meshtrain_export.json"
TOKENIZER_NOTE = "meshtrain_tokenizer.json"
EXPORT_SHARD_SIZE = "5GB"  # an export's weight files hold at most this each (the Hugging Face Hub's convention)


@dataclass(frozen=True)
class Trained:
    """φ loaded into the spec's model (eval mode, on the CPU).

    signed: the swarm's signed spec. step, round: the checkpoint's. model: the spec's model with
    φ. tokenizer: the spec's tokenizer. context: the sequence length the swarm trains on.
    """

    signed: SignedSpec
    step: int
    round: int
    model: torch.nn.Module
    tokenizer: Tokenizer
    context: int


def spec_tokenizer(signed: SignedSpec) -> Tokenizer:
    """The spec's tokenizer; chars takes its alphabet from the spec's dataset, as the trainer does."""
    spec = signed.spec
    if spec.model.tokenizer == "bytes":
        return ByteTokenizer()
    if spec.model.tokenizer == "chars":
        vocab = getattr(load_data(spec), "vocab", None)  # chars: the built-in corpus only
        return CharTokenizer(str(getattr(vocab, "chars", "")))
    return load_tokenizer(spec.model.tokenizer)


def load_spec(data_dir: str | os.PathLike[str]) -> SignedSpec:
    """The signed spec of the node whose data dir is `data_dir` (ConfigError if it is none)."""
    root = Path(data_dir).expanduser()
    if not (root / SPEC_FILE).is_file():
        raise ConfigError(
            f"{root} is not a meshtrain node's data dir (no {SPEC_FILE}); pass the --data-dir the node ran with"
        )
    return SignedSpec.load(root / SPEC_FILE)


def load_trained(data_dir: str | os.PathLike[str]) -> Trained:
    """φ from the newest checkpoint under a node's data dir (module docstring)."""
    root = Path(data_dir).expanduser()
    signed = load_spec(root)
    spec = signed.spec
    if spec.pipeline.kind != "none":
        raise ConfigError(
            f"{root} is a peer of a pipeline swarm: its checkpoints hold one stage; "
            "`meshtrain export` assembles the whole model (node/stages/export.py)"
        )
    ckpt_dir = root / CHECKPOINT_DIR
    ckpt = CheckpointStore(ckpt_dir, readonly=True).load_latest() if ckpt_dir.is_dir() else None
    if ckpt is None:
        raise ConfigError(
            f"no checkpoint in {ckpt_dir} yet: the node saves one every --checkpoint-every seconds and when it stops"
        )
    check_local_copy(
        spec.model.source, spec.model.tokenizer, model_pin=spec.model.digest, tokenizer_pin=spec.model.tokenizer_digest
    )
    tokenizer = spec_tokenizer(signed)
    model = build_model(spec, tokenizer.vocab_size)
    try:
        phi = ckpt.state["outer"]["outer_params"]
        model.load_state_dict(ckpt.state["model"])
        params = dict(model.named_parameters())
        missing = set(phi) ^ {n for n, p in params.items() if p.requires_grad}
        if missing:
            raise ConfigError(f"{ckpt.path}: φ does not fit the spec's model (e.g. {sorted(missing)[0]})")
        with torch.no_grad():
            for name, value in phi.items():
                params[name].copy_(value)
    except (KeyError, TypeError, RuntimeError) as e:
        raise ConfigError(
            f"{ckpt.path}: not a checkpoint of this swarm's model ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        ) from None
    model.eval()
    return Trained(
        signed, ckpt.step, ckpt.round, model, tokenizer, resolve_context(model, spec.model.context, spec.model.source)
    )


def _save_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    if isinstance(tokenizer, HFTokenizer):
        backend = tokenizer.backend
        if not tokenizer.is_transformers:
            from transformers import PreTrainedTokenizerFast

            eos = backend.id_to_token(tokenizer.eos_id) if tokenizer.eos_id is not None else None
            backend = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos)
        backend.save_pretrained(str(out))
        return
    note: dict[str, Any] = {"kind": tokenizer.name}
    if isinstance(tokenizer, CharTokenizer):
        note["chars"] = tokenizer.chars
    (out / TOKENIZER_NOTE).write_text(json.dumps(note, ensure_ascii=False, indent=1) + "\n")


def _save_model(trained: Trained, out: Path) -> None:
    from huggingface_hub import save_torch_model

    model, spec = trained.model, trained.signed.spec
    if isinstance(model, HFCausalLM):
        model.inner.save_pretrained(str(out), max_shard_size=EXPORT_SHARD_SIZE)
        return
    save_torch_model(model, out, max_shard_size=EXPORT_SHARD_SIZE)
    if isinstance(model, GPT):
        config = {"meshtrain_model": spec.model.source, "gpt_config": dataclasses.asdict(model.config)}
    else:
        config = {
            "meshtrain_model": spec.model.source,
            "factory": spec.model.source,
            "model_digest": spec.model.digest,
            "vocab_size": trained.tokenizer.vocab_size,
        }
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")


def export_model(data_dir: str | os.PathLike[str], out: str | os.PathLike[str]) -> dict[str, Any]:
    """Write φ of the node at `data_dir` as a standalone model into `out` (module docstring).
    Returns what `meshtrain_export.json` says. A pipeline swarm's peer holds one stage: export it
    with `pipeline_export.export_pipeline` (what `meshtrain export` does for one)."""
    check_export_target(out)
    return write_export(load_trained(data_dir), out)


def check_export_target(out: str | os.PathLike[str]) -> Path:
    """`out` as a path, if it is free for an export (absent, or an empty directory); else ConfigError."""
    target = Path(out).expanduser()
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConfigError(f"{target} exists and is not an empty directory; export into a new one")
    return target


def write_export(trained: Trained, out: str | os.PathLike[str], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write `trained` into `out` (module docstring: written beside, renamed into place); `extra`
    goes into `meshtrain_export.json` too. Returns what that file says, and `out`."""
    target = check_export_target(out)
    spec = trained.signed.spec
    tmp = target.with_name(f".tmp-{target.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        raise ConfigError(f"cannot export into {target}: {e.strerror or e} (--out chooses another)") from None
    try:
        _save_model(trained, tmp)
        _save_tokenizer(trained.tokenizer, tmp)
        info = {
            "swarm_id": trained.signed.swarm_id,
            "step": trained.step,
            "round": trained.round,
            "model": spec.model.source,
            "model_digest": spec.model.digest,
            "tokenizer": spec.model.tokenizer,
            "tokenizer_digest": spec.model.tokenizer_digest,
            "context": trained.context,
            "parameters": sum(p.numel() for p in trained.model.parameters()),
            **(extra or {}),
        }
        (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=1) + "\n")
        if target.exists():
            target.rmdir()  # empty (checked above)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {**info, "out": str(target)}


@torch.no_grad()
def generate(trained: Trained, prompt: str, *, max_new_tokens: int = 100, top_k: int = 0, seed: int = 0) -> str:
    """The continuation of `prompt` (module docstring, "Sample")."""
    if max_new_tokens < 0 or top_k < 0:
        raise ConfigError("max_new_tokens and top_k must be >= 0")
    tok = trained.tokenizer
    ids = tok.encode(prompt)
    if not ids:
        raise ConfigError("the prompt is empty after tokenisation; give some text")
    generator = torch.Generator().manual_seed(seed)
    new: list[int] = []
    for _ in range(max_new_tokens):
        window = torch.tensor([(ids + new)[-trained.context :]], dtype=torch.int64)
        logits = next_token_logits(trained.model, window)[0, : tok.vocab_size].float()
        if top_k:
            values, indices = logits.topk(min(top_k, logits.numel()))
            nxt = int(indices[torch.multinomial(values.softmax(-1), 1, generator=generator)])
        else:
            nxt = int(logits.argmax())
        if tok.eos_id is not None and nxt == tok.eos_id:
            break
        new.append(nxt)
    return tok.decode(new)
