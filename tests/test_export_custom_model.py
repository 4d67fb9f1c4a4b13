"""examples/export_custom_model.py: a custom module's phone inference programs (ONNX, ExecuTorch)
agree with eager torch, and what cannot be exported says why (the exporter's own reason, per
format; the bundle's refusal of a checkpoint without a zoo config). The whole example (training +
both exports, ~70 s) is slow; the rest runs in the default suite."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_api import CONFIG, USERS, TinyLM, WordIds
from torch import nn

import dpfleet

ROOT = Path(__file__).resolve().parents[1]


def _example():
    spec = importlib.util.spec_from_file_location("export_custom_model",
                                                  ROOT / "examples" / "export_custom_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class ValueBranch(nn.Module):
    """Python control flow on a tensor's value: torch.export cannot trace it."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(64, 8), nn.Linear(8, 64)

    def forward(self, ids):
        h = self.embed(ids)
        if ids.sum() > 100:
            h = h * 2
        return self.head(h)


def test_a_custom_gru_exports_to_onnx_and_agrees_with_eager(tmp_path):
    ex = _example()
    torch.manual_seed(0)
    model = ex.custom_model.GRULanguageModel(64, 8, 16)
    report = ex.export_inference(model, 8, tmp_path, formats=("onnx",))["onnx"]
    assert report["exported"] and Path(report["path"]).stat().st_size == report["bytes"]
    assert report["top1"] == 1.0 and report["max_abs_err"] <= 1e-5 * max(1.0, report["ref_max_abs"])
    from dpfleet.export.phone import InferenceProgram  # the file really computes the model's logits

    rows = np.random.default_rng(1).integers(4, 64, (3, 8), dtype=np.int64)
    with torch.no_grad():
        ref = model.eval()(torch.from_numpy(rows)).numpy()
    np.testing.assert_allclose(InferenceProgram(Path(report["path"]), "onnx", 1)(rows), ref, atol=1e-5)


def test_a_model_the_exporters_refuse_gets_their_reason_per_format(tmp_path):
    report = _example().export_inference(ValueBranch(), 8, tmp_path)
    assert not report["pte"]["exported"] and not report["onnx"]["exported"]
    for fmt in ("pte", "onnx"):  # the root cause, not the exporter's wrapper
        assert "data-dependent" in report[fmt]["why_not"], report[fmt]["why_not"]
    assert report["pte"]["why_not"].startswith("ExecuTorch export refused this model")
    assert not list(tmp_path.glob("model.*"))  # nothing half-written


def test_the_bundle_refuses_a_custom_models_checkpoint_and_says_why(tmp_path):
    torch.manual_seed(0)
    result = dpfleet.simulate({**CONFIG, "rounds": 1}, model=TinyLM(), users=USERS, tokenizer=WordIds(),
                              progress=False, run_dir=tmp_path / "run")
    why = _example().bundle_why_not(result.run_dir / "checkpoint", tmp_path / "bundle")
    assert "missing model_config.json" in why and "zoo ModelConfig" in why
    assert not (tmp_path / "bundle").exists() or not any((tmp_path / "bundle").iterdir())


@pytest.mark.slow
def test_example_trains_then_exports_both_formats(tmp_path):
    report = _example().main(tmp_path, progress=False)
    for fmt in ("onnx", "pte"):
        r = report["inference"][fmt]
        assert r["exported"] and r["top1"] >= 0.99 and r["max_abs_err"] <= 1e-4 * max(1.0, r["ref_max_abs"])
    assert "zoo ModelConfig" in report["bundle"]
    assert json.loads((tmp_path / "export_report.json").read_text()) == json.loads(json.dumps(report))
    assert (tmp_path / "phone" / "tokenizer").is_dir()
