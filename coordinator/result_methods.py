"""What a finished run's model does for its user: keyboard predictions, a phone export, and the
`Result` of a run directory read back (`Result.load`, for runs the CLI made).

`Result` (coordinator/run.py) takes these methods from `ResultMethods`; they need only its
`model`, `tokenizer` and `run_dir`. Predictions are `edge.suggest.Predictor`'s (eval mode, no
gradients, the run's training window); the exports are `export.phone.PhoneExport`'s (the
inference program) and `export.bundle.BundleExport`'s (the signed bundle with on-device
training), given the module itself when the checkpoint holds a custom model that no config can
rebuild.
"""

from __future__ import annotations

import dataclasses
import json
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpfleet.coordinator.engine.field_metrics import tff_figures
from dpfleet.coordinator.state.run_record import read_run
from dpfleet.edge.suggest import Predictor
from dpfleet.errors import DpfleetError
from dpfleet.export.checkpoint import CONFIG, TOKENIZER, custom_model_class, load_weights
from dpfleet.export.models import ModelConfig, build_model
from dpfleet.export.phone import MIN_TOP1

CHECKPOINT = "checkpoint"


class ResultMethods:
    """Methods of `Result` (a frozen dataclass with `model`, `tokenizer` and `run_dir`)."""

    model: nn.Module
    tokenizer: Any
    run_dir: Path

    @cached_property
    def _predictor(self) -> Predictor:
        return Predictor(self.model, self.tokenizer, _seq_len(self.run_dir))

    def suggest(self, text: str, k: int = 3) -> list[str]:
        """Up to `k` words a keyboard would offer after `text`, likeliest first: the next word when
        `text` ends in a space or punctuation, else completions of the word being typed ("I will"
        completes "will"; "I will " gives the next word). Subword pieces are joined into whole
        words (`edge.suggest`). Needs the tokenizer's `decode`."""
        return self._predictor.suggest(text, k)

    def predict(self, text: str, k: int = 5) -> list[tuple[str, float]]:
        """The `k` likeliest next tokens after `text`: (the text each appends, its probability),
        likeliest first; special tokens left out. Needs the tokenizer's `decode`."""
        return self._predictor.predict(text, k)

    def probabilities(self, text: str) -> torch.Tensor:
        """The model's next-token distribution after `text`: a [vocab] tensor summing to 1."""
        return self._predictor.probabilities(text)

    def export(self, out: str | Path, format: str = "onnx", *, quantize: str | None = None,
               heldout: str | Path | None = None, seq_len: int | None = None, threads: int = 1,
               target: str = "x86", min_top1: float = MIN_TOP1, accept_int8_drop: bool = False) -> dict:
        """The model's phone inference program in `out` (new or empty): what `dpfleet export
        RUN/checkpoint --format ... --out ...` writes, for a custom module too (the CLI cannot
        rebuild one). `format` "onnx" or "pte" (ExecuTorch); `seq_len` defaults to the run's
        window. Returns the export's summary (agreement with eager, latency, files, `log`: the
        exporters' own output, kept out of the terminal). A model an exporter refuses is one
        `DpfleetError` with the exporter's reason."""
        from dpfleet.export.phone import PhoneExport

        checkpoint = Path(self.run_dir) / CHECKPOINT
        zoo = (checkpoint / CONFIG).is_file()  # the zoo's model: the CLI's path, its config in the manifest
        window = seq_len or _seq_len(self.run_dir) or 20
        training = self.model.training
        try:
            return PhoneExport(checkpoint, format, Path(out), quantize, int(window), threads,
                               None if heldout is None else Path(heldout), target, min_top1,
                               accept_int8_drop, model=None if zoo else self.model,
                               tokenizer=None if zoo else self.tokenizer).run()
        finally:
            self.model.train(training)

    def export_bundle(self, out: str | Path, *, runtimes: tuple[str, ...] = ("onnx",),
                      signing_key: str | Path | None = None, seq_len: int | None = None,
                      batch_size: int | None = None, heldout: str | Path | None = None,
                      serial: int | None = None, accept_caveats: bool = False, threads: int = 1,
                      policy: str | Path | None = None) -> dict:
        """The signed phone bundle of the run's model in `out` (new or empty): what `dpfleet
        export RUN/checkpoint --bundle OUT` writes, for a custom module too (the CLI cannot
        rebuild one): its training program (ONNX; `runtimes=("onnx", "executorch")` adds the
        `.pte`), window program, weights, tokenizer, manifest and signature. The bundle ships the
        checkpoint's weights; `seq_len` and `batch_size` default to the run's. A custom module's
        bundle has no streaming step program (suggestions run the window program), and the export
        checks one epoch of its training program against eager torch. The signing key defaults to
        `<out>.signing_key.pem`, generated once. A run that is not fully private needs
        `accept_caveats=True`. `policy`: a release policy file the run must meet first (a
        `DpfleetError` naming each rule it misses; the manifest records the policy and the values
        passed). Returns the export's summary (files, `public_key`, `measured`)."""
        from dpfleet.export.bundle import BundleExport
        from dpfleet.export.policy import ReleasePolicy

        checkpoint = Path(self.run_dir) / CHECKPOINT
        zoo = (checkpoint / CONFIG).is_file()
        return BundleExport(checkpoint, Path(out), tuple(runtimes),
                            None if signing_key is None else Path(signing_key), seq_len, batch_size,
                            threads, heldout=None if heldout is None else Path(heldout), serial=serial,
                            accept_caveats=accept_caveats, model=None if zoo else self.model,
                            tokenizer=None if zoo else self.tokenizer,
                            policy=None if policy is None else ReleasePolicy.load(policy)).run()

    @classmethod
    def load(cls, run_dir: str | Path, model: nn.Module | None = None, tokenizer: Any = None):
        """The `Result` of a finished run directory (what `dpfleet simulate` wrote). A zoo model
        is rebuilt from the checkpoint; a custom one needs `model`, an instance of its class, which
        gets the checkpoint's weights; a run with your own tokenizer needs `tokenizer`."""
        run_dir = Path(run_dir)
        record = read_run(run_dir)
        if record.summary is None or record.privacy is None:
            raise DpfleetError(f"{run_dir} is not a finished run (no summary.json / privacy.json): "
                               "resume it with dpfleet simulate --resume first")
        summary, privacy = record.summary, record.privacy
        checkpoint = run_dir / CHECKPOINT
        if model is None:
            if not (checkpoint / CONFIG).is_file():
                name = custom_model_class(checkpoint)
                raise DpfleetError(f"{run_dir} trained a custom model ({name}) that no config can rebuild: "
                                   f"pass model=, e.g. Result.load('{run_dir}', model={name}(...))")
            try:
                cfg = ModelConfig(**json.loads((checkpoint / CONFIG).read_text()))
            except (OSError, ValueError, TypeError) as exc:
                raise DpfleetError(f"{checkpoint / CONFIG}: invalid model config ({exc})") from exc
            model = load_weights(checkpoint, build_model(cfg), "the config")
        elif not isinstance(model, nn.Module):
            raise DpfleetError(f"model must be a torch.nn.Module, not {type(model).__name__}")
        else:
            model = load_weights(checkpoint, model, f"the given {type(model).__name__}")
        final, baseline = summary.get("final") or {}, summary.get("unigram_baseline") or {}
        initial = summary.get("initial") or {}  # round 0 (an older run has none)
        values = dict(
            initial_accuracy=initial.get("accuracy"), initial_perplexity=initial.get("perplexity"),
            keyboard=summary.get("keyboard"), tff=tff_figures(final, baseline),
            accuracy=final.get("accuracy"), unigram_accuracy=baseline.get("accuracy"),
            perplexity=final.get("perplexity"), unigram_perplexity=baseline.get("perplexity"),
            epsilon=privacy.get("epsilon"), delta=privacy.get("delta"), run_dir=run_dir, model=model,
            tokenizer=_run_tokenizer(checkpoint, tokenizer), metrics=record.metrics, privacy=privacy,
            stopped_early=summary.get("stopped_early"), client_trainer=summary.get("client_trainer", ""))
        names = {f.name for f in dataclasses.fields(cls)}  # the other fields read summary.json's keys
        values.update({n: tuple(summary[n]) if isinstance(summary[n], list) else summary[n]
                       for n in names - set(values) if n in summary})
        return cls(**{n: v for n, v in values.items() if n in names})


def _run_tokenizer(checkpoint: Path, tokenizer: Any) -> Any:
    """The caller's tokenizer, else the one the checkpoint saved (SentencePiece or words)."""
    if tokenizer is not None:
        return tokenizer
    from dpfleet.edge.tokenizer import load_tokenizer

    try:
        meta = json.loads((checkpoint / TOKENIZER / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return load_tokenizer(checkpoint / TOKENIZER)  # it names what is wrong
    if not isinstance(meta, dict) or meta.get("kind") not in ("sentencepiece", "word"):
        name = meta.get("class", "saved by its own save()") if isinstance(meta, dict) else "unknown"
        raise DpfleetError(f"{checkpoint.parent} was trained with your own tokenizer ({name}): pass "
                           "tokenizer=")
    return load_tokenizer(checkpoint / TOKENIZER)


def _seq_len(run_dir: Path) -> int | None:
    """The run's training window (data.seq_len of its config.json)."""
    return read_run(run_dir).config.get("data", {}).get("seq_len")
