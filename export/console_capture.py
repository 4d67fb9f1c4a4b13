"""The exporters' own output, kept out of the user's terminal, and their refusals in one line.

torch.export, the ONNX exporter, torchao and ExecuTorch print progress, deprecation warnings,
library-loading notes and, when they refuse a model, the whole FX graph (about 50 lines per
attempt) to stdout / stderr; some of it comes from C++ (ExecuTorch's cpuinfo and threadpool
lines), which redirecting `sys.stderr` never sees. `capture` points file descriptors 1 and 2,
`sys.stdout` / `sys.stderr`, warnings and logging's stream handlers at one log file while an
export runs; progress bars write to `terminal()`, the real stderr. An export command keeps that
log next to its output folder (`log_path`: `<out>.export.log`, so a refused export keeps it and
a signed bundle never ships it) and names it in one line. `DPFLEET_EXPORT_DEBUG=1` turns the
capture off (everything reaches the terminal, and a refusal keeps its traceback).

`exporter_step` wraps one exporter call: an exception there is the exporter refusing the model,
raised as `ExportRefused`, one line (the root cause's first line and the file it came from) that
names the log, which gets the full traceback.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import shutil
import sys
import tempfile
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from dpfleet.errors import DpfleetError

DEBUG_ENV = "DPFLEET_EXPORT_DEBUG"
LOG_SUFFIX = ".export.log"

_active: Capture | None = None


class ExportRefused(DpfleetError):
    """An exporter (torch.export, ONNX, ExecuTorch lowering) refused the model: one line."""


def log_path(out: Path) -> Path:
    """Where an export into `out` keeps the exporters' output: `<out>.export.log`, beside it."""
    out = Path(out).absolute()
    return out.with_name(out.name + LOG_SUFFIX)


def terminal() -> IO[str] | None:
    """The stream progress bars write to while a capture runs (the real stderr), else None (a
    bar's default, `sys.stderr`)."""
    return _active.terminal if _active is not None else None


def debugging() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip() not in ("", "0")


class Capture:
    """One log file that fds 1 / 2, `sys.stdout` / `sys.stderr`, warnings and logging write to.

    `path` is where the log ends up once the capture closes: the `target` given (written only if
    something was captured), else a kept temporary file when a refusal named it, else None."""

    def __init__(self, target: Path | None):
        self.target = None if target is None else Path(target)
        self.keep = False  # a refusal named the log: keep it even without a target
        self.path: Path | None = None
        self._saved: dict[int, int] = {}
        self._handlers: list[tuple[logging.StreamHandler, IO]] = []

    @property
    def final_path(self) -> Path:
        """Where the log will be once closed (what a refusal message names)."""
        return self.target if self.target is not None else Path(self._file.name)

    def __enter__(self) -> Capture:
        self._file = tempfile.NamedTemporaryFile("ab", buffering=0, prefix="dpfleet-export-",
                                                 suffix=".log", delete=False)
        self.text = io.TextIOWrapper(self._file, encoding="utf-8", errors="replace",
                                     line_buffering=True, write_through=True)
        self._streams = sys.stdout, sys.stderr
        for stream in self._streams:
            with contextlib.suppress(Exception):
                stream.flush()
        self.terminal, self._own_terminal = self._streams[1], None
        for fd in (1, 2):
            try:
                self._saved[fd] = os.dup(fd)
                os.dup2(self._file.fileno(), fd)
            except OSError:  # no such descriptor (an embedded interpreter): Python-level capture only
                self._saved.pop(fd, None)
        if 2 in self._saved and _is_fd(self._streams[1], 2):  # sys.stderr is fd 2, now the log
            self._own_terminal = os.fdopen(os.dup(self._saved[2]), "w", buffering=1,
                                           encoding=getattr(self._streams[1], "encoding", None))
            self.terminal = self._own_terminal
        sys.stdout = sys.stderr = self.text
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("default")
        warnings.showwarning = self._show_warning
        for handler in _stream_handlers():
            if handler.stream in (*self._streams, sys.__stdout__, sys.__stderr__):
                self._handlers.append((handler, handler.stream))
                handler.setStream(self.text)
        return self

    def _show_warning(self, message, category, filename, lineno, file=None, line=None) -> None:
        self.text.write(warnings.formatwarning(message, category, filename, lineno, line))

    def __exit__(self, *exc) -> None:
        for handler, stream in reversed(self._handlers):
            handler.setStream(stream)
        self._warnings.__exit__(*exc)
        self.text.flush()
        sys.stdout, sys.stderr = self._streams
        for fd, saved in self._saved.items():
            os.dup2(saved, fd)
            os.close(saved)
        if self._own_terminal is not None:
            self._own_terminal.close()
        self.text.close()
        self._finish(Path(self._file.name))

    def _finish(self, tmp: Path) -> None:
        if tmp.stat().st_size == 0 and not self.keep:
            tmp.unlink()
            return
        if self.target is None:
            if self.keep:
                self.path = tmp
            else:  # a library call that asked for no log: its noise is dropped
                tmp.unlink()
            return
        try:
            self.target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(tmp, self.target)
            self.path = self.target
        except OSError:  # an unwritable output folder: the log stays where it was captured
            self.path = tmp


@contextlib.contextmanager
def capture(target: Path | None = None) -> Iterator[Capture | None]:
    """Capture everything written while the block runs (`Capture`); inside another capture it
    writes to that one's log. None under `DPFLEET_EXPORT_DEBUG` (nothing captured)."""
    global _active
    if _active is not None or debugging():
        yield _active
        return
    cap = Capture(target)
    _active = cap
    try:
        with cap:
            yield cap
    finally:
        _active = None


@contextlib.contextmanager
def exporter_step(what: str) -> Iterator[None]:
    """One exporter call (`what`: "ONNX export", "ExecuTorch export", ...), captured. An
    exception from it is the exporter refusing the model: `ExportRefused` naming `what`, the
    reason and the log (which gets the traceback). A `DpfleetError` passes through unchanged."""
    with capture() as cap:
        try:
            yield
        except DpfleetError:
            raise
        except Exception as exc:
            missing = missing_edge_package(exc)
            if missing:
                raise DpfleetError(f"{what} needs the package {missing!r}, which the edge extra "
                                   "installs: pip install 'dpfleet[edge]'") from None
            if cap is None:  # DPFLEET_EXPORT_DEBUG: the traceback is the point
                raise
            cap.text.write(f"\n{what} refused the model:\n")
            traceback.print_exception(exc, file=cap.text)
            cap.keep = True
            raise ExportRefused(f"{what} refused this model: {reason(exc)}; the exporter's full "
                                f"output: {cap.final_path}") from exc


# the edge extra's packages (pyproject.toml); an exporter imports some of them only when it runs
EDGE_PACKAGES = ("executorch", "onnx", "onnxruntime", "onnxscript")


def missing_edge_package(exc: BaseException) -> str | None:
    """The edge-extra package whose absence `exc` (or an exception it wraps) reports, if any:
    not the exporter refusing the model but an install to make."""
    while exc is not None:
        if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] in EDGE_PACKAGES:
            return exc.name.split(".")[0]
        exc = exc.__cause__ or exc.__context__
    return None


def reason(exc: BaseException) -> str:
    """An exporter's exception in one line: its root cause (exporters wrap it), that cause's first
    non-empty message line, and the file it was raised in."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    origin = f" (in {Path(where.filename).parent.name}/{Path(where.filename).name})" if where else ""
    return f"{type(exc).__name__}: {lines[0][:300] if lines else ''}{origin}"


def _is_fd(stream: object, fd: int) -> bool:
    try:
        return stream.fileno() == fd
    except (AttributeError, OSError, ValueError):
        return False


def _stream_handlers() -> list[logging.StreamHandler]:
    """Every logging handler that writes to a stream (not a file), once each."""
    loggers = [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values()
                                      if isinstance(lg, logging.Logger))]
    found = {id(h): h for lg in loggers for h in lg.handlers
             if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)}
    return list(found.values())
