"""Checkpoint folders: `model.safetensors` + `model_config.json` + `tokenizer/`.

The simulate job writes one per run (`<run>/checkpoint/`); `dpfleet export` reads it. The tensors
are the model's state_dict under its `named_parameters()` names, so a checkpoint also round-trips
through the flat weight layout.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from dpfleet.edge.tokenizer import SentencePieceTokenizer, WordTokenizer, load_tokenizer
from dpfleet.errors import DpfleetError
from dpfleet.export.models import ModelConfig, build_model

WEIGHTS = "model.safetensors"
CONFIG = "model_config.json"
TOKENIZER = "tokenizer"
NOT_PRIVATE = "not_private.json"  # present: the weights must not ship (`save_checkpoint`)


def save_checkpoint(
    folder: Path,
    model: nn.Module,
    cfg: ModelConfig | None,
    tokenizer: SentencePieceTokenizer | WordTokenizer,
    not_private: str | None = None,
) -> Path:
    """`cfg` None: a model from outside the zoo (`dpfleet.simulate(model=...)`); only its weights
    and tokenizer are written, since no config can rebuild it. `not_private`: why these weights
    are not private (a deliberately broken audit run): written to `not_private.json` before the
    weights, so `load_checkpoint` (and with it `dpfleet export`) refuses them; a stale mark from
    an earlier run in the same folder is removed otherwise."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if not_private:
        (folder / NOT_PRIVATE).write_text(json.dumps({"private": False, "why": not_private}, indent=2))
    else:
        (folder / NOT_PRIVATE).unlink(missing_ok=True)
    tensors = {n: p.detach().contiguous() for n, p in model.named_parameters()}
    save_file(tensors, str(folder / WEIGHTS))
    if cfg is not None:
        (folder / CONFIG).write_text(json.dumps(cfg.to_dict(), indent=2))
    tokenizer.save(folder / TOKENIZER)
    return folder


def load_checkpoint(
    folder: Path,
) -> tuple[ModelConfig, nn.Module, SentencePieceTokenizer | WordTokenizer]:
    """(config, model in eval mode, tokenizer); every defect is one clear DpfleetError."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    if not folder.is_dir():
        raise DpfleetError(f"checkpoint folder not found: {folder}")
    check_private(folder)
    for name in (WEIGHTS, CONFIG, TOKENIZER):
        if not (folder / name).exists():
            raise DpfleetError(f"{folder} is not a checkpoint: missing {name}")
    try:
        cfg = ModelConfig(**json.loads((folder / CONFIG).read_text()))
    except (ValueError, TypeError) as exc:
        raise DpfleetError(f"{folder / CONFIG}: invalid model config ({exc})") from exc
    try:
        tensors = load_file(str(folder / WEIGHTS))
    except (SafetensorError, OSError) as exc:
        raise DpfleetError(f"{folder / WEIGHTS}: unreadable weights ({exc})") from exc
    model = build_model(cfg)
    expected = dict(model.named_parameters())
    if set(tensors) != set(expected):
        missing = sorted(set(expected) - set(tensors))
        extra = sorted(set(tensors) - set(expected))
        raise DpfleetError(
            f"{folder / WEIGHTS}: weights do not match the config (missing "
            f"{missing[:3]}, unexpected {extra[:3]})"
        )
    for name, p in expected.items():
        if tensors[name].shape != p.shape:
            raise DpfleetError(
                f"{folder / WEIGHTS}: {name} has shape {tuple(tensors[name].shape)}, "
                f"config says {tuple(p.shape)}"
            )
    model.load_state_dict(tensors, strict=False)  # non-persistent buffers are rebuilt by the model
    model.eval()
    tokenizer = load_tokenizer(folder / TOKENIZER)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise DpfleetError(
            f"{folder}: tokenizer has {tokenizer.vocab_size} tokens, the model only {cfg.vocab_size}"
        )
    return cfg, model, tokenizer


def check_private(folder: Path) -> None:
    """One DpfleetError naming why, for a checkpoint marked not private (`save_checkpoint`); an
    unreadable mark still refuses: its presence is the refusal."""
    path = Path(folder) / NOT_PRIVATE
    if not path.exists():
        return
    try:
        why = str(json.loads(path.read_text())["why"])
    except (ValueError, KeyError, TypeError, OSError):
        why = f"marked by {path.name}"
    raise DpfleetError(f"{folder} is not private and must not be exported or shipped: {why}")
