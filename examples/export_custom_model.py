"""Export the custom GRU of `examples/custom_model.py` for a phone, or say exactly why not.

    python examples/export_custom_model.py [OUT_DIR] [--formats=onnx,pte]

What a custom module CAN get: the phone's *inference* program (next-token logits for a keyboard),
from Python: `result.export(out, format="onnx" | "pte")` on the run's `Result` (for a run made
earlier, `dpfleet.Result.load(run_dir, model=GRULanguageModel(...))` first). It is the exporter
`dpfleet export CHECKPOINT --format` runs (ONNX with a dynamic batch; ExecuTorch + XNNPACK, batch
1), checked against eager torch on held-out text (top-1 agreement, max |logit error|) and written
with the tokenizer and a manifest. The command line cannot do it: the checkpoint holds the GRU's
weights but not its class, and `dpfleet export` says so in one line, naming this Python call.

It also gets a signed phone *bundle*, the package a phone trains with in federated rounds:
`result.export_bundle(out)` (`dpfleet export CHECKPOINT --bundle` on a zoo model). Its training
program is exported from the module itself and checked for one epoch against eager torch through
the reference device client; unlike a zoo bundle it has no streaming step program, so suggestions
run the window program.

A model an exporter refuses (e.g. Python control flow on tensor values, which `torch.export`
cannot trace) is one line with the exporter's reason, per format; everything the exporters print
(warnings, logs, the FX graph of a refusal) goes to `<out>.export.log` instead of the terminal.

The GRU is trained first by `examples/custom_model.py` (DP-FTRL + SecAgg, ~10 s). Exporting the
`.pte` takes ~30 s on 2 cores, the ONNX ~10 s. The run's `Result` also suggests words
(`result.suggest(text)`), printed at the end.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import custom_model  # noqa: E402

import dpfleet  # noqa: E402
from dpfleet.errors import DpfleetError  # noqa: E402

FORMATS = ("onnx", "pte")


def export_or_why_not(result: dpfleet.Result, out: Path, fmt: str, heldout: Path | None = None) -> dict:
    """The format's inference program written to `out` and checked against eager, or
    {"exported": False, "why_not": the exporter's one-line reason}."""
    try:
        summary = result.export(out, format=fmt, heldout=heldout)
    except DpfleetError as exc:  # the exporter's refusal is the answer, not a crash
        return {"exported": False, "why_not": str(exc)}
    program = out / next(name for name in summary["files"] if name.startswith("model."))
    return {"exported": True, "path": str(program), "bytes": program.stat().st_size,
            "log": summary["log"], **summary["agreement"]}


def bundle_or_why_not(result: dpfleet.Result, out: Path) -> dict:
    """The signed bundle's training parity with eager torch, or {"exported": False, "why_not": ...}."""
    try:
        summary = result.export_bundle(out, accept_caveats=True)  # the manifest records any caveats
    except DpfleetError as exc:
        return {"exported": False, "why_not": str(exc)}
    return {"exported": True, "path": str(out), "bytes": summary["total_bytes"],
            "public_key": summary["public_key"], **summary["measured"]["train_vs_eager"]}


def main(out: Path, formats=FORMATS, progress: bool = True) -> dict:
    result = custom_model.main(out / "run", progress=progress)
    users = custom_model.shakespeare_users()
    heldout = out / "heldout.txt"  # the agreement check runs on real text
    heldout.write_text("\n".join(t for texts in list(users.values())[-40:] for t in texts[:5]))
    report = {"inference": {fmt: export_or_why_not(result, out / "phone" / fmt, fmt, heldout)
                            for fmt in formats}}
    report["bundle"] = bundle_or_why_not(result, out / "bundle")
    report["suggest"] = {text: result.suggest(text) for text in ("My good lo", "I will ")}
    for fmt, r in report["inference"].items():
        print(f"{fmt}: " + (f"exported {r['path']} ({r['bytes']:,} bytes), top-1 agreement with eager "
                            f"{r['top1']:.3f}, max |logit error| {r['max_abs_err']:.2e}"
                            if r["exported"] else r["why_not"]))
    b = report["bundle"]
    print("phone bundle (on-device training): " + (
        f"{b['path']} ({b['bytes']:,} bytes), one epoch's delta within {b['max_abs_err']:.2e} of eager"
        if b["exported"] else b["why_not"]))
    print("suggestions: " + "; ".join(f"{text!r} -> {words}" for text, words in report["suggest"].items()))
    (out / "export_report.json").write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--formats")]
    fmts = next((a.split("=", 1)[1].split(",") for a in sys.argv[1:] if a.startswith("--formats=")), FORMATS)
    main(Path(args[0]) if args else Path(tempfile.mkdtemp(prefix="dpfleet-export-")), tuple(fmts))
