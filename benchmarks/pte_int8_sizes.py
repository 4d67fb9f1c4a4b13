"""Size of the int8 `.pte` window program at Gboard's CIFG size: fp32 embedding table vs int8 table.

`dpfleet export --format pte --quantize int8` quantizes the matmuls (XNNPACK dynamic int8) and,
for untied models, the input embedding table (`quantized_decomposed::embedding_byte`). Random
weights (sizes do not depend on them); ONNX int8 alongside for comparison. Also records the
agreement with eager on random windows (the real-text agreement is `int8_agreement.py`'s).
Saves benchmarks/results/pte_int8_sizes.json.

    python benchmarks/pte_int8_sizes.py
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from dpfleet.export.models import ModelConfig, build_model, count_parameters
from dpfleet.export.phone import InferenceProgram, agreement, onnx_program, pte_program, random_windows

RESULTS = Path(__file__).parent / "results" / "pte_int8_sizes.json"
SEQ_LEN = 20


def main() -> None:
    torch.set_num_threads(1)
    cfg = ModelConfig()
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    out = {"host": {"cpu_count": os.cpu_count(), "torch_threads": 1, "loadavg_start": os.getloadavg()},
           "config": cfg.to_dict(), "parameters": count_parameters(model), "seq_len": SEQ_LEN, "seed": 0,
           "results": {}}
    rows, lengths = random_windows(cfg, SEQ_LEN, n=16)
    with tempfile.TemporaryDirectory() as tmp:
        for name, fmt, table in (("pte_fp32", "pte", False), ("pte_int8_fp32_table", "pte", False),
                                 ("pte_int8_int8_table", "pte", True), ("onnx_int8_x86", "onnx", False)):
            start = time.perf_counter()
            path = Path(tmp) / f"{name}.{fmt}"
            quantize = None if name == "pte_fp32" else "int8"
            if fmt == "pte":
                path.write_bytes(pte_program(model, SEQ_LEN, quantize, quantize_embedding=table))
            else:
                onnx_program(model, SEQ_LEN, quantize, path)
            agree = agreement(model, InferenceProgram(path, fmt, 1), rows, lengths)
            out["results"][name] = {"bytes": path.stat().st_size, "agreement_random_windows": agree,
                                    "export_seconds": round(time.perf_counter() - start, 1)}
            print(f"{name:22s} {path.stat().st_size / 1e6:6.2f} MB  top1 {agree['top1']:.4f} "
                  f"max|err| {agree['max_abs_err']:.3g}", flush=True)
    out["host"]["loadavg_end"] = os.getloadavg()
    out["fp32_table_over_int8_table"] = float(np.divide(out["results"]["pte_int8_fp32_table"]["bytes"],
                                                        out["results"]["pte_int8_int8_table"]["bytes"]))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
