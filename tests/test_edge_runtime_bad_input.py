"""Bad program files and bad weights give one clear DpfleetError, never a crash.

Dangerous cases (bytes that could crash native code) run in a child process, so a segfault
fails the test instead of killing pytest.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from bundle_helpers import program_cache
from edge_models import SEQ_LEN, tiny_config

from dpfleet.edge.runtime import EagerRuntime
from dpfleet.edge.runtimes import make_runtime
from dpfleet.errors import DpfleetError
from dpfleet.export.models import ModelConfig
from dpfleet.export.training import (
    ProgramSpec,
    read_program_file,
    training_program,
)
from dpfleet.io import sha256_hex

pytest.importorskip("executorch")
pytest.importorskip("onnxruntime")

CFG = tiny_config("cifg")  # the parity tests' CIFG: the session's program cache serves both files
OTHER = ModelConfig(**{**CFG.to_dict(), "arch": "lstm"})


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return program_cache(tmp_path_factory)  # one export per program for the whole run


@pytest.fixture(scope="module")
def programs(cache_dir):
    return {
        fmt: training_program(ProgramSpec(CFG, SEQ_LEN, 4 if fmt == "pte" else None, fmt), cache_dir)
        for fmt in ("pte", "onnx")
    }


def tampered(program, tmp_path, data: bytes, fix_sidecar: bool):
    """A copy of `program` holding `data`; with `fix_sidecar` its recorded hash matches too."""
    path = tmp_path / program.path.name
    path.write_bytes(data)
    meta = json.loads(program.path.with_name(program.path.name + ".json").read_text())
    if fix_sidecar:
        meta["sha256"] = sha256_hex(data)
    path.with_name(path.name + ".json").write_text(json.dumps(meta))
    return read_program_file(path)


def load(fmt, program, layout_cfg=CFG):
    from dpfleet.edge.runtime_executorch import PteTrainingProgram
    from dpfleet.edge.runtime_onnx import OnnxTrainingProgram
    from dpfleet.export.models import build_model
    from dpfleet.export.params import ParamLayout

    layout = ParamLayout.of(build_model(layout_cfg))
    if fmt == "pte":
        return PteTrainingProgram(program, layout)
    return OnnxTrainingProgram(program, layout, threads=1)


@pytest.mark.parametrize("fmt", ["pte", "onnx"])
@pytest.mark.slow
def test_corrupt_file_is_caught_by_its_hash(fmt, programs, tmp_path):
    data = bytearray(programs[fmt].path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: could crash the runtime if it got there
    bad = tampered(programs[fmt], tmp_path, bytes(data), fix_sidecar=False)
    with pytest.raises(DpfleetError, match="corrupt"):
        load(fmt, bad)


@pytest.mark.parametrize("fmt", ["pte", "onnx"])
@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
@pytest.mark.slow
def test_malformed_file_with_matching_hash_is_a_clear_error(fmt, damage, programs, tmp_path):
    data = programs[fmt].path.read_bytes()
    data = {
        "truncated": data[: len(data) // 3],
        "garbage": np.random.default_rng(0).bytes(4096),
        "empty": b"",
    }[damage]
    bad = tampered(programs[fmt], tmp_path, data, fix_sidecar=True)
    with pytest.raises(DpfleetError, match="cannot load|not an ExecuTorch"):
        load(fmt, bad)


@pytest.mark.parametrize("fmt", ["pte", "onnx"])
@pytest.mark.slow
def test_program_of_another_model_is_refused(fmt, programs):
    with pytest.raises(DpfleetError, match="another model"):
        load(fmt, programs[fmt], layout_cfg=OTHER)


@pytest.mark.slow
def test_format_mix_up_is_refused(programs, tmp_path):
    """An ONNX file presented as a .pte (sidecar claims pte) fails cleanly."""
    pte, onnx = programs["pte"], programs["onnx"]
    bad = tampered(pte, tmp_path, onnx.path.read_bytes(), fix_sidecar=True)
    with pytest.raises(DpfleetError, match="not an ExecuTorch program"):
        load("pte", bad)


@pytest.mark.slow
def test_missing_sidecar_is_a_clear_error(programs, tmp_path):
    path = tmp_path / "lonely.pte"
    shutil.copy(programs["pte"].path, path)
    with pytest.raises(DpfleetError, match="sidecar"):
        read_program_file(path)


@pytest.mark.parametrize("runtime", ["executorch", "onnx"])
@pytest.mark.slow
def test_wrong_weights_and_tokens_are_refused(runtime, cache_dir, programs):
    rt = make_runtime(runtime, CFG, SEQ_LEN, 1, cache_dir)
    n = EagerRuntime(CFG).get_weights().size
    for wrong in (np.zeros(n - 1, np.float32), np.zeros((n, 1), np.float32)):
        with pytest.raises(DpfleetError, match="shape"):
            rt.set_weights(wrong)
    rows = np.full((3, SEQ_LEN + 1), 5)
    rows[1, 2] = CFG.vocab_size  # one id past the embedding table
    with pytest.raises(DpfleetError, match="token ids"):
        rt.train_epoch(rows, lr=0.1, batch_size=4, seed=0)
    with pytest.raises(DpfleetError, match="at most"):
        rt.train_epoch(np.ones((3, SEQ_LEN + 3), np.int64), lr=0.1, batch_size=4, seed=0)


def test_unknown_runtime_name(cache_dir):
    with pytest.raises(DpfleetError, match="unknown runtime"):
        make_runtime("tflite", CFG, SEQ_LEN, 1, cache_dir)


@pytest.mark.slow
def test_program_buffer_outlives_the_caller(programs):
    """The runtime keeps the bytes ExecuTorch reads from: dropping the caller's copy and
    collecting garbage must not invalidate the program (it would segfault if it did)."""
    script = textwrap.dedent(f"""
        import gc, numpy as np
        from pathlib import Path
        from dpfleet.edge.runtime_executorch import PteTrainingProgram
        from dpfleet.export.models import ModelConfig, build_model
        from dpfleet.export.params import ParamLayout, get_flat
        from dpfleet.export.training import read_program_file
        cfg = ModelConfig(**{CFG.to_dict()!r})
        model = build_model(cfg)
        prog = PteTrainingProgram(read_program_file(Path({str(programs["pte"].path)!r})),
                                  ParamLayout.of(model))
        gc.collect()
        prog.set_flat(get_flat(model))
        x = np.full((4, {SEQ_LEN}), 5, dtype=np.int64)
        for _ in range(3):
            gc.collect()
            loss = prog.step(x, x, 0.1)
        print("loss", loss)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.split()[-1]) > 0


@pytest.mark.slow
def test_thread_count_cannot_change_under_a_loaded_program(programs):
    """Resizing ExecuTorch's process-wide threadpool under a live program would crash its next
    run, so it is refused; the same count is a no-op."""
    from executorch.extension.pybindings.portable_lib import _threadpool_get_thread_count

    from dpfleet.edge.pte_module import set_threads

    program = load("pte", programs["pte"])
    current = _threadpool_get_thread_count()
    set_threads(current)
    with pytest.raises(DpfleetError, match="process-wide threadpool"):
        set_threads(current + 1)
    program.set_flat(program.get_flat())  # still runs
    x = np.full((4, SEQ_LEN), 5, dtype=np.int64)
    assert np.isfinite(program.step(x, x, 0.0))
