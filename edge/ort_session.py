"""An ONNX Runtime CPU session over bytes already verified by the caller (torch-free)."""

from __future__ import annotations

from pathlib import Path

from dpfleet.errors import DpfleetError


def load_session(data: bytes, origin: Path | str, threads: int | None):
    """An ORT CPU session over `data`; a malformed model is a DpfleetError, not a crash."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.inter_op_num_threads = 1
    # Idle ORT threads would spin and steal the host's (and other simulated clients') cores.
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if threads:
        opts.intra_op_num_threads = int(threads)
    try:
        return ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])
    except Exception as exc:  # ORT raises its own exception types for every malformed model
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DpfleetError(f"cannot load ONNX program {origin}: {first}") from exc
