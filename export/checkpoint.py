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


def save_checkpoint(
    folder: Path, model: nn.Module, cfg: ModelConfig | None, tokenizer: SentencePieceTokenizer | WordTokenizer
) -> Path:
    """`cfg` None: a model from outside the zoo (`dpfleet.simulate(model=...)`); only its weights
    and tokenizer are written, since no config can rebuild it."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
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
