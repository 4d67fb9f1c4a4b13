"""Choose a training runtime by name (the simulate config's `runtime` key).

The coordinator only sees the `TrainingRuntime` interface, so swapping eager torch for an exported
ExecuTorch or ONNX Runtime program changes no other code. Exported runtimes build their program
on first use and cache it in `cache_dir` under a content hash: create one runtime per simulation
and reuse it for every client (setting weights is a copy).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from dpfleet.edge.runtime import EagerRuntime, TrainingRuntime
from dpfleet.errors import DpfleetError
from dpfleet.export.models import ModelConfig

RUNTIMES = ("eager", "executorch", "onnx")


def make_runtime(
    name: str, cfg: ModelConfig, seq_len: int, threads: int | None, cache_dir: Path
) -> TrainingRuntime:
    """A runtime training `cfg` on rows of at most `seq_len` + 1 tokens."""
    if name == "eager":
        return EagerRuntime(cfg, threads)
    if name == "executorch":
        _require("executorch", name)
        from dpfleet.edge.runtime_executorch import ExecuTorchRuntime

        return ExecuTorchRuntime(cfg, seq_len, threads, cache_dir)
    if name == "onnx":
        _require("onnxruntime", name)
        _require("onnxscript", name)
        from dpfleet.edge.runtime_onnx import OnnxRuntime

        return OnnxRuntime(cfg, seq_len, threads, cache_dir)
    raise DpfleetError(f"unknown runtime {name!r}; choose from {RUNTIMES}")


def _require(package: str, runtime: str) -> None:
    if importlib.util.find_spec(package) is None:
        raise DpfleetError(f"runtime {runtime!r} needs the {package} package: pip install {package}")
