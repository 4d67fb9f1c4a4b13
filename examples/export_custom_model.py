"""Export the custom GRU of `examples/custom_model.py` for a phone, or say exactly why not.

    python examples/export_custom_model.py [OUT_DIR] [--formats onnx,pte]

What a custom module CAN get: the phone's *inference* program (next-token logits for a keyboard),
exported by the same functions `dpfleet export CHECKPOINT --format pte|onnx` uses
(`export.phone.pte_program`: ExecuTorch + XNNPACK, batch 1; `export.phone.onnx_program`:
ONNX, dynamic batch), each checked against eager torch on held-out windows (top-1 agreement,
max |logit error|) and written with the tokenizer.

What it CANNOT get today, and why: a signed phone *bundle* (`dpfleet export CHECKPOINT --bundle`),
the package a phone trains with in federated rounds. The bundle's training, window and streaming
programs, its parameter layout and its manifest rules are all generated from a zoo
`ModelConfig` (export/training.py `ProgramSpec.cfg`, export/checkpoint.py `load_checkpoint`);
a custom module's checkpoint holds its weights and tokenizer but no zoo config, so the bundle
exporter refuses it, and this script prints that refusal. A model that an exporter refuses
(e.g. Python control flow on tensor values, which `torch.export` cannot trace) gets the
exporter's own reason, per format, instead of a traceback.

The GRU is trained first by `examples/custom_model.py` (DP-FTRL + SecAgg, ~10 s). Exporting the
`.pte` takes ~30 s on 2 cores, the ONNX ~10 s.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
import traceback
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import custom_model  # noqa: E402

from dpfleet.errors import DpfleetError  # noqa: E402

FORMATS = ("onnx", "pte")


def _reason(exc: BaseException) -> str:
    """The exporter's refusal in one line: the root cause (exporters wrap it) and its first
    message line, and the exporter module it came from."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    origin = f" (in {Path(where.filename).parent.name}/{Path(where.filename).name})" if where else ""
    return f"{type(exc).__name__}: {lines[0][:300] if lines else ''}{origin}"


def export_inference(model: nn.Module, seq_len: int, out: Path, formats=FORMATS,
                     windows: tuple[np.ndarray, np.ndarray] | None = None) -> dict:
    """Each format's inference program written to `out`, checked against eager; a format an
    exporter refuses gets {"exported": False, "why_not": the exporter's reason}."""
    from dpfleet.export.phone import InferenceProgram, agreement, onnx_program, pte_program
    from dpfleet.export.training import quiet_export

    model = model.eval()
    vocab = _vocab(model, seq_len)
    if windows is None:  # random token windows, BOS first
        rows = np.random.default_rng(0).integers(4, vocab, (32, seq_len), dtype=np.int64)
        rows[:, 0] = 1
        windows = rows, np.full(len(rows), seq_len)
    out.mkdir(parents=True, exist_ok=True)
    report = {}
    for fmt in formats:
        path = out / f"model.{fmt}"
        try:
            with quiet_export():
                if fmt == "pte":
                    path.write_bytes(pte_program(model, seq_len, None))
                else:
                    onnx_program(model, seq_len, None, path)
        except Exception as exc:  # the exporter's refusal is the answer, not a crash
            path.unlink(missing_ok=True)
            report[fmt] = {"exported": False, "why_not": f"{'ExecuTorch' if fmt == 'pte' else 'ONNX'} "
                                                        f"export refused this model: {_reason(exc)}"}
            continue
        check = agreement(model, InferenceProgram(path, fmt, threads=1), *windows)
        report[fmt] = {"exported": True, "path": str(path), "bytes": path.stat().st_size, **check}
    return report


def _vocab(model: nn.Module, seq_len: int) -> int:
    with torch.no_grad():
        return int(model(torch.full((1, seq_len), 4, dtype=torch.int64)).shape[-1])


def bundle_why_not(checkpoint: Path, out: Path) -> str | None:
    """None if `dpfleet export CHECKPOINT --bundle` accepts the checkpoint, else its reason."""
    from dpfleet.export.bundle import BundleExport

    try:
        BundleExport(checkpoint=checkpoint, out=out).run()
    except DpfleetError as exc:
        return (f"dpfleet export --bundle refused it ({exc}): a bundle's training, window and "
                "streaming programs and its manifest are generated from a zoo ModelConfig, which a "
                "custom module's checkpoint does not have")
    return None


def main(out: Path, formats=FORMATS, progress: bool = True) -> dict:
    result = custom_model.main(out / "run", progress=progress)
    seq_len = custom_model.CONFIG["data"]["seq_len"]
    tokenizer = result.run_dir / "checkpoint" / "tokenizer"
    from dpfleet.edge.tokenizer import load_tokenizer
    from dpfleet.export.phone import text_windows

    tok = load_tokenizer(tokenizer)
    users = custom_model.shakespeare_users()
    held_out = [t for texts in list(users.values())[-40:] for t in texts][:200]
    report = {"inference": export_inference(result.model, seq_len, out / "phone", formats,
                                            text_windows(tok, held_out, seq_len))}
    tok.save(out / "phone" / "tokenizer")
    report["bundle"] = bundle_why_not(result.run_dir / "checkpoint", out / "bundle") or "exported"
    for fmt, r in report["inference"].items():
        print(f"{fmt}: " + (f"exported {r['path']} ({r['bytes']:,} bytes), top-1 agreement with eager "
                            f"{r['top1']:.3f}, max |logit error| {r['max_abs_err']:.2e}"
                            if r["exported"] else r["why_not"]))
    print(f"phone bundle (on-device training): {report['bundle']}")
    (out / "export_report.json").write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--formats")]
    fmts = next((a.split("=", 1)[1].split(",") for a in sys.argv[1:] if a.startswith("--formats=")), FORMATS)
    main(Path(args[0]) if args else Path(tempfile.mkdtemp(prefix="dpfleet-export-")), tuple(fmts))
