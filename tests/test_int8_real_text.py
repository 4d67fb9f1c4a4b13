"""int8 on real text: the refusal threshold acts on the measured agreement, not on a flag.

A small word-level CIFG is trained (seconds, eager SGD) on the embedded Shakespeare lines of some
speakers; held-out lines come from other speakers. The ONNX int8 export's top-1 agreement with
eager is measured once; an export asked for a threshold just above that value is refused with the
value in its one error line, and one just below it passes and records the check in its manifest.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from bundle_helpers import train_rows

from dpfleet.cli import main
from dpfleet.edge.client_data import group_by_user, split_users, to_rows
from dpfleet.edge.tokenizer import WordTokenizer
from dpfleet.export.checkpoint import save_checkpoint
from dpfleet.export.manifest import verify_manifest
from dpfleet.export.models import ModelConfig, build_model

pytest.importorskip("onnxruntime")

SEQ_LEN = 12


@pytest.fixture(scope="module")
def real_checkpoint(shakespeare_records, tmp_path_factory):
    by_user = group_by_user(shakespeare_records)
    train_users, test_users = split_users(list(by_user), 0.1, seed=0)
    train = [t for u in train_users[:300] for t in by_user[u]]
    heldout = [t.replace("\n", " ") for u in test_users[:40] for t in by_user[u]][:300]
    tok = WordTokenizer.build(train, 2000)
    cfg = ModelConfig(arch="cifg", vocab_size=tok.vocab_size, embedding_dim=32, hidden_dim=96,
                      projection_dim=32)
    data = torch.from_numpy(to_rows((tok.encode(t) for t in train), SEQ_LEN).astype(np.int64))
    torch.manual_seed(0)
    model = build_model(cfg)
    train_rows(model, data, steps=300, min_drop=1.0)  # it learned something of the language
    folder = tmp_path_factory.mktemp("real") / "ckpt"
    save_checkpoint(folder, model, cfg, tok)
    text = folder.parent / "heldout.txt"
    text.write_text("\n".join(heldout))
    return folder, text


def export(capsys, ckpt, out, *extra) -> dict:
    folder, heldout = ckpt
    main(["export", str(folder), "--format", "onnx", "--quantize", "int8", "--out", str(out),
          "--seq-len", str(SEQ_LEN), "--heldout", str(heldout), *extra])
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow  # a real 300-step training; test_export_phone covers the refusal by default
def test_refusal_triggers_on_the_measured_agreement(real_checkpoint, tmp_path, capsys):
    measured = export(capsys, real_checkpoint, tmp_path / "probe", "--accept-int8-drop", "--min-top1", "0")
    agree = measured["agreement"]
    top1, positions = agree["top1"], agree["positions"]
    assert positions > 1000
    assert 0.5 < top1 < 1.0  # int8 really changes some real-text predictions; the value is not pinned
    assert agree["top3"] >= top1 and agree["max_abs_err"] > 1e-3
    half_step = 0.5 / positions  # one position more or less

    above = tmp_path / "above"
    with pytest.raises(SystemExit) as info:
        export(capsys, real_checkpoint, above, "--min-top1", f"{top1 + half_step:.8f}")
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1
    assert f"agreement with eager is {top1:.4f}" in err and f"over {positions} held-out positions" in err
    assert not above.exists()

    below = tmp_path / "below"
    passed = export(capsys, real_checkpoint, below, "--min-top1", f"{top1 - half_step:.8f}")
    assert passed["agreement"]["top1"] == top1  # the same program, the same measurement
    check = verify_manifest(below)["quantization"]["int8_check"]
    assert check["passed"] and not check["accepted_below_threshold"]
    assert check["min_top1"] == pytest.approx(top1 - half_step, abs=1e-8)
