"""`dpfleet secagg bench`."""

import json

import pytest

from dpfleet.cli import main


def test_bench_json_reports_an_exact_sum(capsys):
    main(["secagg", "bench", "--clients", "12", "--dim", "1e3", "--dropout", "0.25", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["sum_exact"] is True
    assert result["survivors"] == 9 and result["dim"] == 1000
    assert result["bytes_sent_per_client"]["max"] >= 1000 * 4
    assert set(result["client_seconds_mean"]) == {
        "commit", "advertise", "share", "mask", "consistency", "unmask"}


def test_bench_table(capsys):
    main(["secagg", "bench", "-n", "5", "-d", "64", "--graph", "complete", "--bits", "12",
          "--signed"])
    out = capsys.readouterr().out
    assert "sum_exact: true" in out and "complete graph" in out and "consistency" in out
    assert "sent B/client" in out and "commit" in out


@pytest.mark.parametrize("args,message", [
    (["-n", "1", "-d", "10"], "--clients"),
    (["-n", "4", "-d", "2.5"], "--dim"),
    (["-n", "4", "-d", "10", "--dropout", "1.5"], "--dropout"),
    (["-n", "4", "-d", "10", "--bits", "40"], "--bits"),
    (["-n", "4", "-d", "10", "--dropout", "0.9"], "aborted"),
])
def test_user_mistakes_are_one_line_errors(capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        main(["secagg", "bench", *args, "--json"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err and "Traceback" not in err


def test_help_explains(capsys):
    main(["secagg", "bench", "--help"])
    out = capsys.readouterr().out
    assert "sum_exact" in out and "--graph [complete|harary]" in out
