"""The machine a benchmark ran on, as its JSON records it: the CPU's model name and the instruction
sets that change CPU matmul speed (bf16 / int8 dot products, AMX tiles), the cores, and the load.

Why the flags: the same model's latency differs by several times between a CPU with AMX / AVX-512
BF16 and one without, and a shared machine's load average says how much of it a run really had.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

FLAGS = ("avx512_bf16", "amx_bf16", "amx_int8", "amx_tile", "avx512_vnni", "avx_vnni")


def cpu_model_and_flags() -> tuple[str, set[str]]:
    """lscpu's "Model name" and "Flags" (/proc/cpuinfo's when lscpu is missing)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        cpuinfo = Path("/proc/cpuinfo")
        text = cpuinfo.read_text() if cpuinfo.exists() else ""
    model, flags = "unknown", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key == "model name" and model == "unknown":
            model = value.strip()
        elif key == "flags":
            flags |= set(value.split())
    return model, flags


def host(threads: int) -> dict:
    """The host record: CPU model, which of `FLAGS` it has, cores, the threads the benchmark used,
    and the 1 / 5 / 15-minute load averages now (call it before and after the measurement)."""
    model, flags = cpu_model_and_flags()
    return {"cpu_model": model, "cpu_flags": {f: f in flags for f in FLAGS}, "cpu_count": os.cpu_count(),
            "threads": threads, "loadavg": [round(x, 2) for x in os.getloadavg()]}
