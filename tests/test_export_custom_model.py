"""A custom module end to end for a phone: `Result.export` writes its inference program (agreeing
with eager torch); `dpfleet export` on its checkpoint says in one line what is missing and the
Python call that exports it; a model an exporter refuses is one line with the exporter's reason,
with the exporter's dump (the FX graph) in `<out>.export.log`, not on the terminal. The example
end to end (training + both exports, ~70 s) is slow."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_api import CONFIG, USERS, TinyLM, WordIds
from torch import nn

import dpfleet
from dpfleet.cli import main
from dpfleet.edge.device_client import BundleClient
from dpfleet.edge.tokenizer import WordTokenizer
from dpfleet.errors import DpfleetError
from dpfleet.export.checkpoint import save_checkpoint
from dpfleet.export.console_capture import ExportRefused
from dpfleet.export.phone import InferenceProgram, PhoneExport

pytest.importorskip("onnxruntime")
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


@pytest.fixture(scope="module")
def custom_run(tmp_path_factory):
    """One round of TinyLM (a GRU, not in the zoo) with the caller's own tokenizer."""
    torch.manual_seed(0)
    return dpfleet.simulate({**CONFIG, "rounds": 1}, model=TinyLM(), users=USERS, tokenizer=WordIds(),
                            progress=False, run_dir=tmp_path_factory.mktemp("custom") / "run")


@pytest.mark.slow
def test_result_export_writes_a_custom_modules_program_that_computes_its_logits(custom_run, tmp_path, capfd):
    out = tmp_path / "phone"
    custom_run.model.train()
    summary = custom_run.export(out, format="onnx")
    assert custom_run.model.training  # the caller's mode is restored after the export's eval
    assert summary["seq_len"] == CONFIG["data"]["seq_len"]  # the run's window
    assert summary["agreement"]["top1"] == 1.0 and summary["architecture"] == "TinyLM"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["architecture"] == {"custom": "TinyLM",
                                        "parameters": sum(p.numel() for p in custom_run.model.parameters())}
    rows = np.random.default_rng(1).integers(4, 64, (3, 8), dtype=np.int64)
    with torch.no_grad():
        ref = custom_run.model(torch.from_numpy(rows)).numpy()
    np.testing.assert_allclose(InferenceProgram(out / "model.onnx", "onnx", 1)(rows), ref, atol=1e-5)
    log = Path(summary["log"])  # the ONNX exporter's warnings went to the log, not the terminal
    assert log == tmp_path / "phone.export.log" and log.stat().st_size > 0
    terminal = capfd.readouterr()
    assert terminal.out == "" and terminal.err == ""


@pytest.mark.parametrize("extra", [["--format", "onnx", "--out"], ["--bundle"]])
def test_the_cli_says_in_one_line_what_a_custom_checkpoint_lacks_and_what_to_do(custom_run, tmp_path,
                                                                               capsys, extra):
    with pytest.raises(SystemExit) as exit_info:
        main(["export", str(custom_run.run_dir / "checkpoint"), *extra, str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert "custom model (TinyLM" in err
    call = ".export_bundle('OUT')" if "--bundle" in extra else ".export('OUT', format='onnx')"
    assert f"dpfleet.Result.load('{custom_run.run_dir}', model=TinyLM(...)){call}" in err
    assert not (tmp_path / "out").exists()


def test_a_refused_export_is_one_line_and_its_dump_goes_to_the_log(tmp_path, capfd):
    checkpoint = tmp_path / "checkpoint"
    save_checkpoint(checkpoint, ValueBranch(), None, WordTokenizer(["a", "b"]))
    for fmt, exporter in [("onnx", "ONNX export"), ("pte", "ExecuTorch export")]:
        if fmt == "pte":
            pytest.importorskip("executorch")
        out = tmp_path / fmt
        with pytest.raises(ExportRefused) as refused:
            PhoneExport(checkpoint, fmt, out, seq_len=8, model=ValueBranch()).run()
        message = str(refused.value)
        assert "\n" not in message and message.startswith(f"{exporter} refused this model")
        assert "data-dependent" in message  # the root cause, not the exporter's wrapper
        log = tmp_path / f"{fmt}.export.log"
        assert message.endswith(f"the exporter's full output: {log}")
        assert "def forward" in log.read_text() and "Traceback" in log.read_text()  # the FX graph
        assert not out.exists()  # nothing half-written
    terminal = capfd.readouterr()
    assert terminal.out == "" and terminal.err == ""  # before: 76 lines of FX graph on stderr


def test_load_needs_the_custom_modules_class_and_the_callers_tokenizer(custom_run):
    with pytest.raises(DpfleetError, match=r"custom model \(TinyLM\).*model=TinyLM\(\.\.\.\)"):
        dpfleet.Result.load(custom_run.run_dir)
    with pytest.raises(DpfleetError, match=r"your own tokenizer \(WordIds\): pass tokenizer="):
        dpfleet.Result.load(custom_run.run_dir, model=TinyLM())
    with pytest.raises(DpfleetError, match=r"embed.weight has shape \(64, 8\), the given TinyLM says \(70"):
        dpfleet.Result.load(custom_run.run_dir, model=TinyLM(embed_rows=70), tokenizer=WordIds())
    loaded = dpfleet.Result.load(custom_run.run_dir, model=TinyLM(), tokenizer=WordIds())
    assert torch.equal(loaded.model.head.weight, custom_run.model.head.weight)
    assert (loaded.accuracy, loaded.epsilon, loaded.metrics) == (custom_run.accuracy, custom_run.epsilon,
                                                                 custom_run.metrics)
    with pytest.raises(DpfleetError, match="WordIds has no decode"):  # the caller's tokenizer lacks it
        loaded.suggest("the ")


@pytest.mark.slow
def test_example_trains_then_exports_both_formats(tmp_path):
    report = _example().main(tmp_path, progress=False)
    for fmt in ("onnx", "pte"):
        r = report["inference"][fmt]
        assert r["exported"] and r["top1"] >= 0.99 and r["max_abs_err"] <= 1e-4 * max(1.0, r["ref_max_abs"])
    bundle = report["bundle"]
    assert bundle["exported"] and bundle["max_abs_err"] <= bundle["bound"]
    assert BundleClient(bundle["path"], bundle["public_key"]).suggest("I will ")
    # at most a strip of 3, only words of the lexicon (fewer rather than a non-word)
    assert all(1 <= len(words) <= 3 for words in report["suggest"].values())
    assert json.loads((tmp_path / "export_report.json").read_text()) == json.loads(json.dumps(report))
    assert (tmp_path / "phone" / "onnx" / "tokenizer").is_dir()


def test_executorch_is_a_name_of_the_pte_format(tmp_path):
    pytest.importorskip("executorch")
    checkpoint = tmp_path / "checkpoint"
    save_checkpoint(checkpoint, ValueBranch(), None, WordTokenizer(["a", "b"]))
    with pytest.raises(ExportRefused, match=r"^ExecuTorch export refused this model"):
        PhoneExport(checkpoint, "executorch", tmp_path / "out", seq_len=8, model=ValueBranch()).run()
    with pytest.raises(DpfleetError, match=r"unknown format 'tflite'; choose from pte, onnx"):
        PhoneExport(checkpoint, "tflite", tmp_path / "out", seq_len=8, model=ValueBranch()).run()


def test_a_missing_edge_package_is_named_with_its_install_line(custom_run, tmp_path, monkeypatch):
    """Without onnxscript (the edge extra) the ONNX exporter fails on its import: that is an
    install to make, not the exporter refusing the model. Stand-in: torch.onnx.export raising what
    its `import onnxscript` raises where the package is absent (a process that already imported
    onnxscript would not import it again, so hiding the module alone depends on test order)."""
    import torch.onnx

    def absent(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'onnxscript'", name="onnxscript")

    monkeypatch.setattr(torch.onnx, "export", absent)
    with pytest.raises(DpfleetError) as missing:
        custom_run.export(tmp_path / "onnx", "onnx")
    assert str(missing.value) == ("ONNX export needs the package 'onnxscript', which the edge extra "
                                  "installs: pip install 'dpfleet[edge]'")
    assert not (tmp_path / "onnx").exists()


def test_a_phone_export_follows_the_permission_rule(custom_run, tmp_path):
    import os
    import stat

    before = os.umask(0o022)
    try:
        custom_run.export(tmp_path / "onnx", "onnx")
    finally:
        os.umask(before)
    out = tmp_path / "onnx"
    modes = {p: stat.S_IMODE(p.lstat().st_mode) for p in [out, *out.rglob("*")]}
    assert len(modes) > 3 and {p: m for p, m in modes.items() if m != (0o700 if p.is_dir() else 0o600)} == {}
