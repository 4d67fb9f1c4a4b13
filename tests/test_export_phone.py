"""`dpfleet export`: phone programs agree with eager, manifests verify, int8 keeps top-1.

The checkpoint is a tiny CIFG trained in a few seconds on a structured synthetic language (each
subject has its own verb), so its predictions are confident the way a trained keyboard model's
are; held-out lines come from the same language.
"""

from __future__ import annotations

import json

import pytest
import torch
from bundle_helpers import sentences, train_briefly
from numerics import scaled_bound

from dpfleet.cli import main
from dpfleet.edge.tokenizer import WordTokenizer
from dpfleet.errors import DpfleetError
from dpfleet.export.checkpoint import load_checkpoint, save_checkpoint
from dpfleet.export.manifest import verify_manifest
from dpfleet.export.models import ModelConfig, build_model

pytest.importorskip("executorch")
pytest.importorskip("onnxruntime")

SEQ_LEN = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("ckpt")
    train = sentences(400, seed=0)
    tok = WordTokenizer.build(train, 64)
    cfg = ModelConfig(
        arch="cifg", vocab_size=tok.vocab_size, embedding_dim=16, hidden_dim=32, projection_dim=16
    )
    torch.manual_seed(0)
    model = build_model(cfg)
    train_briefly(model, tok, train, SEQ_LEN, steps=250, max_loss=1.0)  # it learned the language
    save_checkpoint(folder, model, cfg, tok)
    heldout = folder.parent / "heldout.txt"
    heldout.write_text("\n".join(sentences(60, seed=1)))
    return folder, heldout


def run_export(capsys, checkpoint, out, *extra):
    folder, heldout = checkpoint
    main(
        [
            "export",
            str(folder),
            "--out",
            str(out),
            "--seq-len",
            str(SEQ_LEN),
            "--heldout",
            str(heldout),
            *extra,
        ]
    )
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    # the exporters' own output (torch.export, ONNX, ExecuTorch's C++ lines) went to the log
    assert captured.err.splitlines() in ([], [f"exporter output (warnings, logs): {summary['log']}"])
    return summary


@pytest.fixture(scope="module")
def exports(checkpoint, tmp_path_factory):
    """Each (format, quantize) exported once for the whole module."""
    cache = {}

    def get(capsys, fmt, quantize=None):
        if (fmt, quantize) not in cache:
            out = tmp_path_factory.mktemp(f"{fmt}-{quantize}") / "export"
            extra = ["--format", fmt] + (["--quantize", quantize] if quantize else [])
            cache[fmt, quantize] = (out, run_export(capsys, checkpoint, out, *extra))
        return cache[fmt, quantize]

    return get


# the ExecuTorch export (~15 s) in the slow set; the default suite keeps ONNX's and the .pte
# training program's parity (test_edge_runtime_parity)
@pytest.mark.parametrize("fmt", ["onnx", pytest.param("pte", marks=pytest.mark.slow)])
def test_float_export_matches_eager(fmt, exports, capfd):
    out, summary = exports(capfd, fmt)  # capfd: C-level writes to fds 1 and 2 count too
    program = {"onnx": "model.onnx", "pte": "model.pte"}[fmt]
    assert set(summary["files"]) == {program, "tokenizer/tokenizer.json"}
    assert summary["files"][program] == (out / program).stat().st_size > 0
    assert summary["total_bytes"] == sum(summary["files"].values())
    assert summary["agreement"]["max_abs_err"] <= scaled_bound(summary["agreement"]["ref_max_abs"])
    assert summary["agreement"]["top1"] == 1.0
    assert summary["agreement"]["positions"] > 300
    assert summary["latency_ms"]["median"] > 0


@pytest.mark.parametrize("fmt", ["onnx", pytest.param("pte", marks=pytest.mark.slow)])
def test_int8_export_keeps_top1(fmt, exports, capfd):
    out, summary = exports(capfd, fmt, "int8")
    assert summary["quantize"] == "int8"
    assert summary["agreement"]["top1"] >= 0.98
    assert summary["agreement"]["max_abs_err"] > 0  # it really is quantized
    assert verify_manifest(out)["quantize"] == "int8"


def test_manifest_describes_and_verifies(exports, capsys, checkpoint):
    out, _ = exports(capsys, "onnx")
    manifest = verify_manifest(out)
    cfg, _, tok = load_checkpoint(checkpoint[0])
    assert manifest["architecture"] == cfg.to_dict()
    assert manifest["vocabulary"]["size"] == tok.vocab_size == cfg.vocab_size
    assert manifest["dpfleet_version"] and manifest["format"] == "onnx"
    assert manifest["inputs"]["tokens"]["shape"][1] == SEQ_LEN
    assert set(manifest["files"]) == {"model.onnx", "tokenizer/tokenizer.json"}


def test_manifest_catches_tampering(exports, capsys, tmp_path):
    import shutil

    src, _ = exports(capsys, "onnx")
    out = tmp_path / "copy"
    shutil.copytree(src, out)
    verify_manifest(out)
    tok = out / "tokenizer" / "tokenizer.json"
    tok.write_text(tok.read_text().replace("apples", "pears"))
    with pytest.raises(DpfleetError, match="tokenizer/tokenizer.json"):
        verify_manifest(out)
    shutil.copy(src / "tokenizer" / "tokenizer.json", tok)
    verify_manifest(out)
    (out / "extra.bin").write_bytes(b"x")
    with pytest.raises(DpfleetError, match="not in the manifest"):
        verify_manifest(out)


def test_cli_user_mistakes_exit_2(checkpoint, tmp_path, capsys):
    folder, _ = checkpoint
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "file").write_text("x")
    cases = [
        (
            ["export", str(tmp_path / "missing"), "--format", "onnx", "--out", str(tmp_path / "a")],
            "checkpoint folder not found",
        ),
        (["export", str(folder), "--format", "onnx", "--out", str(busy)], "not empty"),
        (
            [
                "export",
                str(folder),
                "--format",
                "onnx",
                "--out",
                str(tmp_path / "b"),
                "--heldout",
                str(tmp_path / "none.txt"),
            ],
            "held-out",
        ),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "b").exists()  # a failed export leaves nothing behind


def test_checkpoint_with_wrong_shapes_is_refused(checkpoint, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(checkpoint[0], bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["output.bias"] = torch.zeros(3)
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(DpfleetError, match="output.bias has shape"):
        load_checkpoint(bad)


def test_int8_agreement_is_in_the_manifest(exports, capsys):
    out, summary = exports(capsys, "onnx", "int8")
    manifest = verify_manifest(out)
    agree = manifest["agreement_with_eager"]
    assert agree == summary["agreement"] and agree["top3"] >= agree["top1"] > 0.9
    check = manifest["quantization"]["int8_check"]
    assert check == {"min_top1": 0.98, "passed": True, "accepted_below_threshold": False}
    assert manifest["quantization"]["reduce_range"] and manifest["target"] == "x86"


@pytest.mark.slow
def test_int8_below_threshold_is_refused_unless_accepted(checkpoint, tmp_path, capsys):
    refused = tmp_path / "refused"
    with pytest.raises(SystemExit) as info:
        run_export(capsys, checkpoint, refused, "--format", "onnx", "--quantize", "int8",
                   "--min-top1", "1.01")
    err = capsys.readouterr().err
    assert info.value.code == 2 and "below --min-top1 1.01" in err and err.count("\n") == 1
    assert not refused.exists()  # nothing left behind
    kept = tmp_path / "kept"
    summary = run_export(capsys, checkpoint, kept, "--format", "onnx", "--quantize", "int8",
                         "--min-top1", "1.01", "--accept-int8-drop", "--target", "arm")
    check = verify_manifest(kept)["quantization"]
    assert check["int8_check"]["accepted_below_threshold"] and not check["reduce_range"]
    assert summary["int8_check"]["passed"] is False


def test_int8_needs_heldout_text(checkpoint, tmp_path, capsys):
    folder, _ = checkpoint
    with pytest.raises(SystemExit) as info:
        main(["export", str(folder), "--format", "onnx", "--quantize", "int8", "--out", str(tmp_path / "x")])
    assert info.value.code == 2 and "needs --heldout" in capsys.readouterr().err
