"""The bfloat16 recurrent cohort's fused elementwise kernels (`lstm_cell.c`: the cell's step forward
and backward, the output layer's softmax cross-entropy, a bfloat16-into-float32 axpy), built at
first use with the machine's C compiler and called through ctypes.

Why build here and not ship a binary: the kernel is compiled for the CPU it runs on
(`-march=native`: AVX-512 where there is one), which a wheel cannot know; it needs only a C
compiler, not torch's headers (a torch C++ extension takes a minute to build and needs ninja),
and it is one small file. The library is cached per source, compiler and CPU in dpfleet's cache
(`$DPFLEET_CACHE/kernels`, `edge/wheel_cache.cache_dir`), so a home folder shared between
machines never loads a library built for another CPU; a cache folder that other users can write
is not used (a library planted there would run as this user): the kernel is built in a private
temporary folder instead, removed once the library is loaded. The library is loaded through a
descriptor of the checked folder (opened without following links; on Linux dlopen reads
/proc/self/fd/N/NAME), so a folder or link swapped in after the check is never what is loaded.
Where there is no compiler, or `DPFLEET_NATIVE=0`, `cell()` says why and the torch ops run
instead (`edge/cohort_lstm.py`).

Every call checks each tensor's dtype, shape and strides against what the C loops index: a
mismatch is a bug here and raises rather than writing out of bounds.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from dpfleet.edge.wheel_cache import cache_dir
from dpfleet.io import private_mkdir

SOURCE = Path(__file__).with_name("lstm_cell.c")
FLAGS = ("-O3", "-march=native", "-fno-trapping-math", "-fno-math-errno", "-fPIC", "-shared",
         # x86: full-width AVX-512 where there is some (gcc prefers 256-bit vectors on Intel
         # server CPUs; the softmax kernel ran 1.13x faster at 512, alone, in one run)
         *(("-mprefer-vector-width=512",) if platform.machine() in ("x86_64", "AMD64") else ()))


@dataclass(frozen=True)
class Cell:
    """The loaded kernel, or why there is none (`lib` None)."""

    lib: ctypes.CDLL | None
    reason: str
    # what decides the bfloat16 path's bits: the library's name (its source, compiler, flags and
    # CPU) or "torch ops" (every fallback runs the same ops); kept by a run's resume points
    identity: str = "torch ops"

    def forward(self, x_pre: torch.Tensor, rec: torch.Tensor, bias: torch.Tensor, a: torch.Tensor,
                c_prev: torch.Tensor, c: torch.Tensor, tc: torch.Tensor, m_low: torch.Tensor,
                coupled: bool) -> None:
        """One step: the gates' pre-activations x_pre + rec [k, B, G] (bfloat16) + bias [k, G]
        (float32), summed in float32 -> their activations in a (float32); c, tanh(c) [k, B, H]
        written (float32), and m = o tanh(c) in m_low (bfloat16); c_prev [k, B, H] (zeros at
        t = 0)."""
        k, rows, gates = a.shape
        hidden = c.shape[-1]
        _check(gates == (3 if coupled else 4) * hidden, "gates", a.shape, hidden)
        args = [_rows(x_pre, k, rows, gates, torch.bfloat16), _rows(rec, k, rows, gates, torch.bfloat16),
                _rows(bias.unsqueeze(1), k, 1, gates, torch.float32)]
        args += [_rows(t, k, rows, w, torch.float32) for t, w in
                 ((a, gates), (c_prev, hidden), (c, hidden), (tc, hidden))]
        args.append(_rows(m_low, k, rows, hidden, torch.bfloat16))
        self.lib.cell_forward(k, rows, hidden, int(coupled), *[x for pair in args for x in pair])

    def backward(self, dm: torch.Tensor, a: torch.Tensor, tc: torch.Tensor, c_prev: torch.Tensor,
                 dc: torch.Tensor, dz: torch.Tensor, coupled: bool) -> None:
        """One backward step: dm = dL/dm_t [k, B, H] (bfloat16); dz [k, B, G] (bfloat16) gets the
        gates' pre-activation gradients; dc [k, B, H] carries dL/dc_t in and f_t dL/dc_t out.
        float32 but dm and dz."""
        k, rows, gates = a.shape
        hidden = dm.shape[-1]
        _check(gates == (3 if coupled else 4) * hidden, "gates", a.shape, hidden)
        args = [_rows(dm, k, rows, hidden, torch.bfloat16)]
        args += [_rows(t, k, rows, w, torch.float32) for t, w in
                 ((a, gates), (tc, hidden), (c_prev, hidden), (dc, hidden))]
        args.append(_rows(dz, k, rows, gates, torch.bfloat16))
        self.lib.cell_backward(k, rows, hidden, int(coupled), *[x for pair in args for x in pair])


    def softmax_xent(self, logits: torch.Tensor, bias: torch.Tensor, target: torch.Tensor,
                     weight: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [m, n, V] (bfloat16, no bias) of m clients with bias [m, V] (float32), target and
        weight [m * n, 1] -> (nll [m * n], bias gradient sum_r w_r grad_r [m, V], float32); grad
        [m, n, V] (bfloat16) becomes softmax(logits + bias) - onehot(target)."""
        m, n, vocab = logits.shape
        _check(logits.dtype == grad.dtype == torch.bfloat16 and logits.is_contiguous()
               and grad.is_contiguous() and grad.shape == logits.shape, "logits", logits.shape)
        _check(bias.dtype == torch.float32 and bias.is_contiguous() and bias.shape == (m, vocab),
               "bias", bias.shape)
        _check(target.dtype == torch.int64 and target.is_contiguous() and target.numel() == m * n,
               "target", target.shape)
        _check(weight.dtype == torch.float32 and weight.is_contiguous() and weight.numel() == m * n,
               "weight", weight.shape)
        _check(bool(((target >= 0) & (target < vocab)).all()), "target range", vocab)
        nll = logits.new_empty(m * n, dtype=torch.float32)
        bias_grad = logits.new_empty(m, vocab, dtype=torch.float32)
        scratch = logits.new_empty(vocab, dtype=torch.float32)
        self.lib.softmax_xent(m, n, vocab, *(t.data_ptr() for t in (
            logits, bias, target, weight, grad, nll, bias_grad, scratch)))
        return nll, bias_grad


    def axpy(self, dst: torch.Tensor, src: torch.Tensor, alpha: float) -> None:
        """dst += alpha * src for a float32 dst and a bfloat16 src of the same shape (up to 3
        dimensions, each with a unit last stride)."""
        _check(dst.dtype == torch.float32 and src.dtype == torch.bfloat16 and dst.shape == src.shape
               and 1 <= dst.dim() <= 3, "axpy operands", dst.dtype, src.dtype, dst.shape, src.shape)
        d3, s3 = (t.view((1,) * (3 - t.dim()) + tuple(t.shape)) if t.dim() < 3 else t for t in (dst, src))
        _check(d3.stride(2) == 1 and s3.stride(2) == 1, "axpy strides", d3.stride(), s3.stride())
        a, r, c = d3.shape
        self.lib.axpy_bf16(a, r, c, d3.data_ptr(), d3.stride(0), d3.stride(1),
                           s3.data_ptr(), s3.stride(0), s3.stride(1), alpha)


    def to_bf16(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous float32 tensor cast to bfloat16 (round to nearest even, as torch casts)."""
        _check(t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu", "cast", t.dtype)
        out = torch.empty(t.shape, dtype=torch.bfloat16)
        self.lib.cast_bf16(t.numel(), t.data_ptr(), out.data_ptr())
        return out


def _check(ok: bool, what: str, *detail: object) -> None:
    if not ok:
        raise ValueError(f"native cell: bad {what}: {detail}")


def _rows(t: torch.Tensor, k: int, rows: int, width: int, dtype: torch.dtype) -> tuple[int, int]:
    """(data pointer, client stride) of a [k, rows, width] tensor whose rows are contiguous (one
    condition: this runs ~15 times per time step)."""
    st = t.stride()
    if (t.dtype is not dtype or t.device.type != "cpu" or t.shape != (k, rows, width) or st[2] != 1
            or (rows > 1 and st[1] != width) or (k > 1 and st[0] < rows * width)):
        raise ValueError(f"native cell: bad layout: {t.dtype} {tuple(t.shape)} {st}, "
                         f"want {dtype} ({k}, {rows}, {width}) with contiguous rows")
    return t.data_ptr(), st[0]


def _cpu_key() -> str:
    """The CPU's model and flags (Linux), else the platform: what `-march=native` compiles for."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))][:2]
        return "\n".join(lines)
    except OSError:
        return platform.processor() + platform.machine()


def _build(compiler: str, out: Path) -> None:
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # compile aside, then rename: two
        # processes building at once each get a whole library
        part = Path(tmp) / out.name
        subprocess.run([compiler, *FLAGS, "-o", str(part), str(SOURCE)], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(part, out)


def _private_dir(path: Path) -> tuple[Path, bool]:
    """(`path`, False) if it is ours and only we can write it (made 0700 if missing), else (a
    fresh private folder, True): a library loaded from a folder others can write could be theirs
    (a planted `.so` runs as this user). Checked before anything changes the folder's mode."""
    if not os.path.lexists(path):
        return private_mkdir(path), False
    st = path.stat()
    if path.is_dir() and _ours(st):
        return path, False
    return Path(tempfile.mkdtemp(prefix="dpfleet-kernels-")), True


def _ours(st: os.stat_result) -> bool:
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


class _Untrusted(OSError):
    """The folder or the library is not (or no longer) ours alone."""


def _open_folder(folder: Path) -> int:
    """A descriptor of `folder`, opened without following a link and checked on the open folder:
    ours, writable by us alone. Loading through it (`_load_from`) loads from this folder, not
    from whatever its path names by the time dlopen reads it: a folder swapped after
    `_private_dir`'s check, by someone who can rename entries in the cache root, is refused."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as err:  # a link put in the folder's place (ELOOP), or a file (ENOTDIR)
        raise _Untrusted(f"{folder} is not a folder of ours: {err}") from err
    if not _ours(os.fstat(fd)):
        os.close(fd)
        raise _Untrusted(f"{folder} is not ours alone")
    return fd


def _has_library(folder_fd: int, path: Path) -> bool:
    """Whether the open folder holds the library `path.name` (a regular file, ours, writable by
    us alone: a link or another's file is refused, not followed)."""
    try:
        st = os.stat(path.name, dir_fd=folder_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if not (stat.S_ISREG(st.st_mode) and _ours(st)):
        raise _Untrusted(f"{path} is not a file of ours alone")
    return True


def _load_from(folder: Path, name: str, compiler: str) -> ctypes.CDLL:
    """The library `folder/name`, built first if missing, loaded through the checked folder's
    descriptor (Linux: /proc/self/fd/N/name; elsewhere the path, checked just before)."""
    fd = _open_folder(folder)
    try:
        if not _has_library(fd, folder / name):
            _build(compiler, folder / name)  # by path: if the folder was swapped, not found below
            if not _has_library(fd, folder / name):
                raise _Untrusted(f"{folder / name} is not in the checked folder after its build")
        through = f"/proc/self/fd/{fd}"
        return ctypes.CDLL(f"{through}/{name}" if os.path.isdir(through) else str(folder / name))
    finally:
        os.close(fd)


def _library(compiler: str) -> tuple[ctypes.CDLL, Path]:
    """The kernel library from the cache (built there if missing), or from a fresh private
    folder, removed once the library is loaded, where the cache is not ours alone
    (`_private_dir`) or its folder or library stops being ours after that check."""
    name = library_name(compiler)
    folder, temporary = _private_dir(cache_dir() / "kernels")
    if not temporary:
        try:
            return _load_from(folder, name, compiler), folder / name
        except _Untrusted:  # swapped or planted after the check: build our own, privately
            folder = Path(tempfile.mkdtemp(prefix="dpfleet-kernels-"))
    try:  # the loaded library stays mapped; its private folder is not kept
        return _load_from(folder, name, compiler), folder / name
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def library_name(compiler: str) -> str:
    """The cached library's file name: the source, the compiler's version, the flags and the CPU."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), version, " ".join(FLAGS), _cpu_key()])
                         .encode()).hexdigest()[:16]
    return f"lstm_cell-{key}.so"


@functools.cache
def cell() -> Cell:
    """The fused cell kernel of this process (built or loaded once)."""
    return load(os.environ)


def load(env: Mapping[str, str]) -> Cell:
    """Build (if its cache has no library for this source, compiler and CPU) and load the kernel,
    or say why not: `DPFLEET_NATIVE=0`, no compiler (`CC`, else cc or gcc on PATH), a failed build."""
    if env.get("DPFLEET_NATIVE", "1") == "0":
        return Cell(None, "torch ops: DPFLEET_NATIVE=0")
    compiler = shutil.which(env.get("CC", "cc")) or (None if "CC" in env else shutil.which("gcc"))
    if compiler is None:
        return Cell(None, f"torch ops: no C compiler ({env.get('CC', 'cc or gcc')} not on PATH)")
    try:
        lib, lib_path = _library(compiler)
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.cell_forward.argtypes = [i64, i64, i64, ctypes.c_int] + [ptr, i64] * 8
        lib.cell_backward.argtypes = [i64, i64, i64, ctypes.c_int] + [ptr, i64] * 6
        lib.softmax_xent.argtypes = [i64, i64, i64] + [ptr] * 8
        lib.axpy_bf16.argtypes = [i64, i64, i64, ptr, i64, i64, ptr, i64, i64, ctypes.c_float]
        lib.cast_bf16.argtypes = [i64, ptr, ptr]
    except (OSError, AttributeError, RuntimeError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", "") or str(err)
        return Cell(None, f"torch ops: the C kernel did not build or load ({detail.strip()[:200]})")
    for fn in (lib.cell_forward, lib.cell_backward, lib.softmax_xent, lib.axpy_bf16, lib.cast_bf16):
        fn.restype = None
    return Cell(lib, f"fused C kernels ({Path(compiler).name} -march=native, {lib_path.name})",
                lib_path.name)
