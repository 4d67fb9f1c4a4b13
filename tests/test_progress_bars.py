"""Every bar comes from `dpfleet.progress.progress_bar`: its caller's flag or DPFLEET_PROGRESS=0
hides it, a terminal-only bar is hidden when its stream is not a terminal, and during an export
the bar given the capture's `terminal()` still reaches the real stderr, not the exporter's log."""

import io

import pytest

from dpfleet.export.console_capture import capture, log_path, terminal
from dpfleet.progress import progress_bar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def drawn(file: io.StringIO, **kwargs) -> str:
    items = list(progress_bar(range(3), desc="counting", unit="item", file=file, **kwargs))
    assert items == [0, 1, 2]  # a hidden bar still iterates
    return file.getvalue()


def test_a_bar_shows_unless_its_caller_or_its_stream_says_no(monkeypatch):
    monkeypatch.delenv("DPFLEET_PROGRESS", raising=False)
    assert "counting: 100%" in drawn(Terminal())
    assert "3/3" in drawn(io.StringIO(), terminal_only=False)  # asked for: a redirected stderr too
    assert drawn(io.StringIO()) == ""  # terminal only: not into a log file or a pipe
    assert drawn(Terminal(), enabled=False) == ""
    bar = progress_bar(total=2, desc="by hand", file=Terminal())
    bar.update(2)
    bar.close()
    assert "by hand: 100%" in bar.fp.getvalue()


@pytest.mark.parametrize("kwargs", [{}, {"terminal_only": False}])
def test_dpfleet_progress_0_hides_every_bar(monkeypatch, kwargs):
    monkeypatch.setenv("DPFLEET_PROGRESS", "0")
    assert drawn(Terminal(), **kwargs) == ""
    assert drawn(io.StringIO(), **kwargs) == ""


def test_an_exports_bar_reaches_the_terminal_not_the_log(tmp_path, capfd):
    target = log_path(tmp_path / "out")
    with capture(target):
        bar = progress_bar(total=2, desc="export stages", unit="stage", file=terminal(), terminal_only=False)
        bar.update(2)
        bar.close()
    assert "export stages: 100%" in capfd.readouterr().err
    assert not target.exists() or "export stages" not in target.read_text()
