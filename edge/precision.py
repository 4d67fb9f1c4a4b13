"""The precision local training and the teacher run at: float32, or bfloat16 where the CPU does it.

Why per CPU at run time: the machines this project runs on differ from day to day. Where the CPU
has native BF16 (AMX-BF16, AVX512-BF16) a bfloat16 GEMM runs at 2x or more the float32 rate and
the larger models sit near the GEMM floor; elsewhere bfloat16 is emulated and slower than
float32. So `[client] precision = "auto"` asks the CPU (through torch's cpuinfo queries, which
work on every OS) and torch (its kernels: `ATEN_CPU_CAPABILITY=default`, the portable kernels,
counts as no native BF16, so that path runs and is tested in float32), and the model: a small
model's GEMMs (the main job's 81k-parameter CIFG) ran no faster in bfloat16, so "auto" keeps
float32 below `AUTO_BF16_MIN_PARAMS` parameters.

bfloat16 means the GEMMs take bfloat16 operands and accumulate in float32: autocast
(`torch.autocast`, `Precision.autocast`) for the transformer, public training and the teacher,
and the hand-written recurrent cohort's own bfloat16 kernels (`Precision.dtype`, see
`edge/cohort_lstm.py`: bfloat16 weight copies made once per local step, not a cast per op).
The weights, the optimiser state, each device's delta, its clipping norm and the DP sum stay
float32 (`edge/client_update.finish_update` casts a delta to float32 before its
norm is taken). An explicit "bfloat16" on a CPU without native BF16 is an error, not a warning
and float32: the config would otherwise not say what ran, and emulated bfloat16 is slower than
float32 anyway.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from dpfleet.errors import DpfleetError

PRECISIONS = ("auto", "float32", "bfloat16")
# "auto" runs bfloat16 only for a model of at least this many parameters (about its GEMMs'
# multiply-adds per token): below it the GEMMs are too small for the faster multiply to pay for the
# casts. Measured (benchmarks/precision_throughput.py, AMX-BF16, cohort steps/s bfloat16 over
# float32, one run on a quiet machine): the main job's CIFG (81,088 parameters) 1.0x at 1 thread
# and 0.48x at 2; the Gboard-size CIFG (1.42M) 1.26x at 1 thread, 0.95x at 2. 2**18 lies between
# the two models; only these two sizes were measured, so the bound is coarse.
AUTO_BF16_MIN_PARAMS = 2**18


@dataclass(frozen=True)
class Precision:
    """What a job runs at and why (the reason is stated in summary.json)."""

    name: str  # "float32" | "bfloat16"
    reason: str  # "auto: CPU has AMX-BF16"

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.name == "bfloat16" else torch.float32

    def autocast(self, device_type: str = "cpu") -> contextlib.AbstractContextManager:
        """bfloat16 autocast on `device_type`, or nothing for float32."""
        if self.name == "bfloat16":
            return torch.autocast(device_type, dtype=torch.bfloat16)
        return contextlib.nullcontext()


FLOAT32 = Precision("float32", "precision = 'float32'")


def native_bf16() -> str | None:
    """The CPU's native BF16 feature torch uses ("AMX-BF16", "AVX512-BF16"), or None: none, or
    torch runs its portable kernels (ATEN_CPU_CAPABILITY=default)."""
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        return None
    if not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    if torch.cpu._is_amx_tile_supported():
        return "AMX-BF16"
    if torch.cpu._is_avx512_bf16_supported():
        return "AVX512-BF16"
    return None


def resolve_precision(requested: str, device_type: str = "cpu", key: str = "precision",
                      params: int | None = None) -> Precision:
    """"auto" | "float32" | "bfloat16" -> the precision to run at on `device_type`, with why.

    "auto" on CPU: bfloat16 where the CPU has native BF16 and the model is large enough to gain
    from it (`params`, its parameter count, >= AUTO_BF16_MIN_PARAMS; None: no size rule, as for a
    teacher), else float32; on CUDA float32 (the rule is the CPU's; CUDA runs are not measured
    here). "bfloat16" where the CPU lacks it: a DpfleetError naming `key` (the config key or
    option it came from); "bfloat16" on a small model runs bfloat16 as asked."""
    if requested not in PRECISIONS:
        raise DpfleetError(f"{key} must be one of {PRECISIONS}, not {requested!r}")
    if requested == "float32":
        return FLOAT32
    if device_type == "cuda":
        if requested == "bfloat16":
            return Precision("bfloat16", "precision = 'bfloat16' (CUDA)")
        return Precision("float32", "auto: float32 on CUDA")
    feature = native_bf16()
    if requested == "bfloat16":
        if feature is None:
            raise DpfleetError(f"{key} = 'bfloat16' but this CPU has no native BF16 ({_why_not()}); "
                               "use 'auto' or 'float32'")
        return Precision("bfloat16", f"precision = 'bfloat16' (CPU has {feature})")
    if feature is None:
        return Precision("float32", f"auto: {_why_not()}")
    if params is not None and params < AUTO_BF16_MIN_PARAMS:
        return Precision("float32", f"auto: CPU has {feature}, but the model's {params:,} parameters "
                         f"are under {AUTO_BF16_MIN_PARAMS:,}: its GEMMs ran no faster in bfloat16")
    return Precision("bfloat16", f"auto: CPU has {feature}")


def _why_not() -> str:
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "DEFAULT":
        return "torch runs its portable kernels, ATEN_CPU_CAPABILITY=default"
    return f"CPU has no AMX-BF16 or AVX512-BF16, torch kernels {capability}"
