"""Loading an ExecuTorch program from bytes safely (no torch import; shared by the simulator's
ExecuTorch runtime and the reference device client).

Facts this relies on (ExecuTorch 1.5.1; tests/test_edge_runtime_bad_input.py checks them): the
runtime does not copy the buffer a program is loaded from (we keep it referenced: dropping it
segfaults), and resetting the process-wide threadpool under a loaded program crashes its next run.
"""

from __future__ import annotations

import weakref
from pathlib import Path

from dpfleet.errors import DpfleetError

PTE_MAGIC = b"ET"  # flatbuffer file identifier "ETnn" at byte offset 4


_LIVE: weakref.WeakSet = weakref.WeakSet()  # loaded programs, which hold the threadpool


def set_threads(threads: int | None) -> None:
    """Size ExecuTorch's process-wide threadpool (used by the XNNPACK delegate).

    Resetting it while a loaded program is alive makes that program's next run segfault
    (measured), so a change of thread count is refused until those programs are dropped.
    """
    from executorch.extension.pybindings.portable_lib import (
        _threadpool_get_thread_count,
        _unsafe_reset_threadpool,
    )

    if not threads or _threadpool_get_thread_count() == threads:
        return
    if len(_LIVE):
        raise DpfleetError(
            f"cannot switch ExecuTorch to {threads} threads while {len(_LIVE)} loaded program(s) "
            "use its process-wide threadpool; use one thread count per process"
        )
    _unsafe_reset_threadpool(int(threads))


class PteModule:
    """An ExecuTorch program loaded from bytes, holding the bytes as long as the module lives.

    Only pass bytes whose sha256 was checked against the exporter's record: the flatbuffer
    verifier does not cover delegate payloads, and a bit-flipped XNNPACK blob can crash the
    process (measured). Truncated or structurally broken files fail here as a DpfleetError.
    """

    def __init__(self, data: bytes, origin: Path):
        from executorch.extension.pybindings.portable_lib import (
            Verification,
            _load_for_executorch_from_buffer,
        )

        if len(data) < 8 or data[4:6] != PTE_MAGIC:
            raise DpfleetError(f"{origin} is not an ExecuTorch program")
        self.origin = origin
        self.buffer = data  # the module reads from this memory: dropping it segfaults
        try:
            self.module = _load_for_executorch_from_buffer(
                data, program_verification=Verification.InternalConsistency
            )
            self.methods = set(self.module.method_names())
            self.metas = {name: self.module.method_meta(name) for name in self.methods}
        except RuntimeError as exc:
            raise DpfleetError(f"cannot load ExecuTorch program {origin}: {exc}") from exc
        _LIVE.add(self)

    def run(self, method: str, args: tuple) -> list:
        try:
            return self.module.run_method(method, args, clone_outputs=False)
        except RuntimeError as exc:
            raise DpfleetError(f"ExecuTorch program {self.origin} failed: {exc}") from exc


