"""The exporters' own output stays out of the terminal (`export/console_capture.py`): prints,
stderr, warnings, logging and C-level writes to fds 1 and 2 all land in the log; progress bars
still reach the terminal; an exporter's exception is one `ExportRefused` line naming the root
cause and the log."""

import logging
import os
import sys
import warnings
from pathlib import Path

import pytest

from dpfleet.errors import DpfleetError
from dpfleet.export import console_capture
from dpfleet.export.console_capture import ExportRefused, capture, exporter_step, log_path


def _noisy() -> None:
    print("a print")
    print("to sys.stderr", file=sys.stderr)
    warnings.warn("a deprecation", DeprecationWarning, stacklevel=1)
    handler = logging.StreamHandler(sys.stderr)  # a library's handler, bound to stderr
    logger = logging.getLogger("dpfleet-test-exporter")
    logger.addHandler(handler)
    try:
        logger.warning("a logged warning")
    finally:
        logger.removeHandler(handler)
    os.write(1, b"C-level stdout\n")  # what ExecuTorch's C++ writes
    os.write(2, b"C-level stderr\n")


def test_everything_written_goes_to_the_log_and_the_terminal_gets_only_the_bar(tmp_path, capfd):
    target = log_path(tmp_path / "out")
    assert target == tmp_path / "out.export.log"
    with capture(target) as cap:
        _noisy()
        print("bar 50%", file=console_capture.terminal())
    assert cap.path == target
    text = target.read_text()
    for line in ("a print", "to sys.stderr", "a deprecation", "a logged warning", "C-level stdout",
                 "C-level stderr"):
        assert line in text, line
    terminal = capfd.readouterr()
    assert terminal.out == "" and terminal.err == "bar 50%\n"
    print("after")  # the streams are back
    os.write(2, b"fd after\n")
    assert capfd.readouterr() == ("after\n", "fd after\n")
    assert console_capture.terminal() is None


def test_nothing_written_leaves_no_log_and_debug_lets_it_through(tmp_path, capfd, monkeypatch):
    with capture(tmp_path / "quiet.log") as cap:
        pass
    assert cap.path is None and not (tmp_path / "quiet.log").exists()
    monkeypatch.setenv(console_capture.DEBUG_ENV, "1")
    with capture(tmp_path / "debug.log") as cap:
        print("visible")
    assert cap is None and capfd.readouterr().out == "visible\n"


def test_an_exporters_exception_is_one_line_with_its_root_cause_and_the_log(tmp_path, capfd):
    def trace():
        try:
            raise RuntimeError("Could not guard on data-dependent expression u0 > 1\n\n<50 lines of graph>")
        except RuntimeError as exc:
            print("def forward(self, ids): ...", file=sys.stderr)  # torch.export's dump
            raise ValueError("export failed, see above") from exc

    with capture(tmp_path / "x.export.log"), pytest.raises(ExportRefused) as refused, \
            exporter_step("ONNX export"):
        trace()
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("ONNX export refused this model: RuntimeError: Could not guard on "
                              "data-dependent expression u0 > 1 (in ")
    assert message.endswith(f"the exporter's full output: {tmp_path / 'x.export.log'}")
    log = (tmp_path / "x.export.log").read_text()
    assert "def forward" in log and "Traceback" in log and "<50 lines of graph>" in log
    assert capfd.readouterr() == ("", "")
    with pytest.raises(DpfleetError, match="^a user mistake$"), exporter_step("ONNX export"):
        raise DpfleetError("a user mistake")  # passes unchanged


def test_a_refusal_without_a_log_keeps_a_temporary_one_and_names_it(capfd):
    with pytest.raises(ExportRefused) as refused, exporter_step("ExecuTorch export"):
        print("graph dump")
        raise NotImplementedError("aten::foo is not supported")
    path = str(refused.value).rsplit("full output: ", 1)[1]
    try:
        assert "NotImplementedError: aten::foo is not supported" in str(refused.value)
        assert "graph dump" in Path(path).read_text()
    finally:
        os.unlink(path)
    assert capfd.readouterr() == ("", "")
