"""Checkpoint folders: `model.safetensors` + `model_config.json` + `tokenizer/`.

The simulate job writes one per run (`<run>/checkpoint/`); `dpfleet export` reads it. The tensors
are the model's state_dict under its `named_parameters()` names, so a checkpoint also round-trips
through the flat weight layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from dpfleet.edge.tokenizer import SentencePieceTokenizer, WordTokenizer, load_tokenizer
from dpfleet.errors import DpfleetError
from dpfleet.export.models import ModelConfig, build_model
from dpfleet.io import atomic_write, private_mkdir
from dpfleet.jsonio import write_json

WEIGHTS = "model.safetensors"
CONFIG = "model_config.json"
TOKENIZER = "tokenizer"
NOT_PRIVATE = "not_private.json"  # present: the weights must not ship (`save_checkpoint`)
CAVEATS = "caveats.json"  # present: the run is not fully private; exports need the caveats accepted
CUSTOM = "custom_model.json"  # a module from outside the zoo: its class, so errors can name it


class CustomModelCheckpoint(DpfleetError):
    """A checkpoint of a custom module (`dpfleet.simulate(model=...)`): weights and tokenizer,
    no zoo config, so nothing here can rebuild the module; the message says what to do."""

    def __init__(self, folder: Path, model_class: str):
        self.folder, self.model_class = folder, model_class
        super().__init__(f"{folder} holds a custom model ({model_class}, trained with "
                         f"dpfleet.simulate(model=...)) and no {CONFIG}, so dpfleet cannot rebuild its "
                         f"module from the folder: {python_export_hint(folder, model_class)}")


def python_export_hint(folder: Path, model_class: str, bundle: bool = False) -> str:
    """How to export a custom model's inference program (`bundle`: its signed phone bundle, with
    on-device training) from Python, given its class."""
    folder = Path(folder)
    if (folder.parent / "summary.json").is_file():  # a run's checkpoint: the Result's method
        call = ".export_bundle('OUT')" if bundle else ".export('OUT', format='onnx')"
        return (f"export it from Python, dpfleet.Result.load('{folder.parent}', model={model_class}(...))"
                + call)
    if bundle:
        return (f"export it from Python, dpfleet.export.bundle.BundleExport('{folder}', 'OUT', "
                f"model={model_class}(...)).run()")
    return (f"export it from Python, dpfleet.export.phone.PhoneExport('{folder}', 'onnx', 'OUT', "
            f"model={model_class}(...)).run()")


def save_checkpoint(
    folder: Path,
    model: nn.Module,
    cfg: ModelConfig | None,
    tokenizer: SentencePieceTokenizer | WordTokenizer,
    not_private: str | None = None,
    caveats: list[str] | None = None,
) -> Path:
    """`cfg` None: a model from outside the zoo (`dpfleet.simulate(model=...)`); only its weights
    and tokenizer are written, since no config can rebuild it. `not_private`: why these weights
    are not private (a deliberately broken audit run): written to `not_private.json` before the
    weights, so `load_checkpoint` (and with it `dpfleet export`) refuses them; a stale mark from
    an earlier run in the same folder is removed otherwise. `caveats`: the run's caveats
    (`coordinator/run_privacy/caveats.py`), written to caveats.json, so an export of the folder,
    wherever it is copied, must accept them (`checkpoint_caveats`); none: a stale file is removed."""
    from safetensors.torch import save

    folder = Path(folder)
    private_mkdir(folder)
    if not_private:
        write_json(folder / NOT_PRIVATE, {"private": False, "why": not_private}, indent=2)
    else:
        (folder / NOT_PRIVATE).unlink(missing_ok=True)
    if caveats:
        write_json(folder / CAVEATS, {"fully_private": False, "caveats": list(caveats)}, indent=2)
    else:
        (folder / CAVEATS).unlink(missing_ok=True)
    tensors = {n: p.detach().contiguous() for n, p in model.named_parameters()}
    atomic_write(folder / WEIGHTS, save(tensors))  # 0600 (dpfleet/io.py)
    if cfg is not None:
        write_json(folder / CONFIG, cfg.to_dict(), indent=2)
        (folder / CUSTOM).unlink(missing_ok=True)
    else:
        write_json(folder / CUSTOM, {"class": type(model).__qualname__, "module": type(model).__module__,
                                     "parameters": sum(t.numel() for t in tensors.values())})
    tokenizer.save(folder / TOKENIZER)
    return folder


def load_checkpoint(
    folder: Path,
) -> tuple[ModelConfig, nn.Module, SentencePieceTokenizer | WordTokenizer]:
    """(config, model in eval mode, tokenizer); every defect is one clear DpfleetError."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DpfleetError(f"checkpoint folder not found: {folder}")
    check_private(folder)
    if not (folder / CONFIG).exists() and (folder / WEIGHTS).exists():
        raise CustomModelCheckpoint(folder, custom_model_class(folder))
    for name in (WEIGHTS, CONFIG, TOKENIZER):
        if not (folder / name).exists():
            raise DpfleetError(f"{folder} is not a checkpoint: missing {name}")
    try:
        cfg = ModelConfig(**json.loads((folder / CONFIG).read_text()))
    except (ValueError, TypeError) as exc:
        raise DpfleetError(f"{folder / CONFIG}: invalid model config ({exc})") from exc
    model = load_weights(folder, build_model(cfg), "the config")
    tokenizer = load_tokenizer(folder / TOKENIZER)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise DpfleetError(
            f"{folder}: tokenizer has {tokenizer.vocab_size} tokens, the model only {cfg.vocab_size}"
        )
    return cfg, model, tokenizer


def load_weights(folder: Path, model: nn.Module, what: str = "your model") -> nn.Module:
    """`model` (in eval mode) holding the checkpoint's weights, which must be exactly its
    parameters (names and shapes; `what` names the model in the error)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(folder) / WEIGHTS
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise DpfleetError(f"{path}: unreadable weights ({exc})") from exc
    expected = dict(model.named_parameters())
    if set(tensors) != set(expected):
        missing = sorted(set(expected) - set(tensors))
        extra = sorted(set(tensors) - set(expected))
        raise DpfleetError(f"{path}: weights do not match {what} (missing {missing[:3]}, unexpected "
                           f"{extra[:3]})")
    for name, p in expected.items():
        if tensors[name].shape != p.shape:
            raise DpfleetError(f"{path}: {name} has shape {tuple(tensors[name].shape)}, {what} says "
                               f"{tuple(p.shape)}")
    with torch.no_grad():  # into the module's own tensors (its device and dtype)
        for name, p in expected.items():
            p.copy_(tensors[name])
    return model.eval()


def custom_model_class(folder: Path) -> str:
    """The class name `save_checkpoint` recorded for a custom module ("your model" if none)."""
    try:
        return str(json.loads((Path(folder) / CUSTOM).read_text())["class"])
    except (OSError, ValueError, KeyError, TypeError):
        return "YourModel"


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


def checkpoint_caveats(folder: Path) -> list[str]:
    """What keeps the checkpoint's run from being fully private, first line first: its
    caveats.json, else (a checkpoint saved before the file existed) the `caveats` of its run's
    privacy.json beside it; [] for a fully private run. Unreadable: one DpfleetError."""
    folder = Path(folder)
    for path, key in ((folder / CAVEATS, "caveats"), (folder.parent / "privacy.json", "caveats")):
        if not path.is_file():
            continue
        try:
            caveats = json.loads(path.read_text()).get(key, [])
        except (OSError, ValueError, AttributeError) as exc:
            raise DpfleetError(f"{path}: unreadable caveats ({exc}); it says whether the run is "
                               "fully private, so the checkpoint cannot be exported without it") from None
        if not isinstance(caveats, list) or not all(isinstance(c, str) for c in caveats):
            raise DpfleetError(f"{path}: `{key}` must be a list of strings")
        return caveats
    return []


def require_accepted(caveats: list[str], accepted: bool, where: Path) -> list[str]:
    """`caveats`, or a DpfleetError naming them and --accept-caveats unless `accepted`: an export
    of a run that is not fully private ships only when its user chose that (the manifest then
    records the caveats it was exported with)."""
    if caveats and not accepted:
        raise DpfleetError(f"{where}: {caveats[0]}; pass --accept-caveats to export it anyway (the "
                           "manifest records the caveats)")
    return list(caveats)
