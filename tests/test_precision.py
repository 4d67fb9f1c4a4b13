"""bfloat16 where the CPU does it natively: the choice, and the privacy path under it.

The attack: a device whose delta was computed in bfloat16 (large, adversarial updates) must still
be clipped exactly, i.e. the delta that is summed has float32 L2 norm <= clip_norm, which holds
only if the delta is cast to float32 before its norm is taken and it is scaled.
"""

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfleet.cli import main
from dpfleet.edge import cohort as cohort_mod
from dpfleet.edge.client_update import finish_update
from dpfleet.edge.clipping import norm64
from dpfleet.edge.cohort import CohortTrainer
from dpfleet.edge.cohort_lstm import recurrent_grads
from dpfleet.edge.precision import native_bf16, resolve_precision
from dpfleet.errors import DpfleetError
from dpfleet.export.models import ModelConfig, build_model
from dpfleet.export.params import get_flat
from dpfleet.public.kd_pretrain import KDTrainConfig, PlainCorpus, kd_train

needs_bf16 = pytest.mark.skipif(native_bf16() is None,
                                reason="no native BF16 here (or ATEN_CPU_CAPABILITY=default)")

L, BATCH = 9, 8
CFG = ModelConfig(arch="cifg", vocab_size=64, embedding_dim=16, hidden_dim=24, projection_dim=16)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), size=st.integers(1, 400), scale=st.floats(1e-3, 1e6),
       clip_norm=st.floats(1e-3, 10.0))
def test_a_bfloat16_delta_is_clipped_exactly_in_float32(seed, size, scale, clip_norm):
    delta = (np.random.default_rng(seed).standard_normal(size) * scale).astype(ml_dtypes.bfloat16)
    update = finish_update(delta, clip_norm, 0.0, 1)
    assert update.delta.dtype == np.float32
    assert norm64(update.delta) <= clip_norm
    assert update.norm == pytest.approx(norm64(delta.astype(np.float32)), rel=1e-12)


def test_auto_is_float32_on_the_portable_kernels(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    choice = resolve_precision("auto")
    assert (choice.name, choice.dtype) == ("float32", torch.float32)
    assert "ATEN_CPU_CAPABILITY=default" in choice.reason
    with pytest.raises(DpfleetError, match="no native BF16"):
        resolve_precision("bfloat16")
    with pytest.raises(DpfleetError, match="precision must be one of"):
        resolve_precision("float16")
    assert resolve_precision("float32").name == "float32"


def test_auto_cohort_on_a_cpu_without_bf16_trains_float32_bit_for_bit(monkeypatch):
    """No native BF16 (simulated: torch's portable kernels): "auto" is float32 and its deltas are
    the float32 trainer's, bit for bit (no bfloat16 GEMM ran)."""
    torch.manual_seed(0)
    theta = get_flat(build_model(CFG))
    examples = [rows(np.random.default_rng(4), n) for n in (5, 11, 8)]

    def deltas(precision):
        trainer = CohortTrainer(CFG, seq_len=L, batch_size=BATCH, device="cpu", chunk=2,
                                precision=precision, processes=False)
        assert trainer.precision.name == "float32"
        return [u.delta for u in trainer.train_round(theta, examples, [1, 2, 3], lr=0.5,
                                                     batch_size=BATCH, clip_norm=10.0)]

    f32 = deltas("float32")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    for a, b in zip(f32, deltas("auto"), strict=True):
        np.testing.assert_array_equal(a, b)


@needs_bf16
def test_auto_is_bfloat16_where_the_cpu_has_it():
    choice = resolve_precision("auto")
    assert choice.name == "bfloat16" and choice.reason == f"auto: CPU has {native_bf16()}"


def rows(rng, n):
    out = rng.integers(4, 64, (n, L + 1)).astype(np.int32)
    out[:, 0] = 1
    return out


@needs_bf16
@pytest.mark.parametrize("fused", [True, False])
def test_bfloat16_cohort_clips_adversarial_devices_exactly(fused, monkeypatch):
    """lr 50 makes every device's update huge; the summed deltas are float32 and within C. The
    fused path's deltas come from its own bfloat16 GEMMs (`recurrent_grads(dtype=bfloat16)`,
    no autocast around it); the torch.func path's from bfloat16 autocast."""
    seen = []

    def spy(*args, dtype=torch.float32, **kwargs):
        seen.append((dtype, torch.is_autocast_enabled("cpu")))
        return recurrent_grads(*args, dtype=dtype, **kwargs)

    monkeypatch.setattr(cohort_mod, "recurrent_grads", spy)
    torch.manual_seed(0)
    theta = get_flat(build_model(CFG))
    rng = np.random.default_rng(1)
    examples = [rows(rng, n) for n in (3, 17, 9, 24)]
    trainer = CohortTrainer(CFG, seq_len=L, batch_size=BATCH, device="cpu", chunk=2, fused=fused,
                            precision="bfloat16", processes=False)
    updates = trainer.train_round(theta, examples, [5, 6, 7, 8], lr=50.0, batch_size=BATCH, clip_norm=0.3)
    assert set(seen) == ({(torch.bfloat16, False)} if fused else set())
    assert any(u.clipped for u in updates)
    for u in updates:
        assert u.delta.dtype == np.float32
        assert norm64(u.delta) <= 0.3
    total = np.sum([u.delta for u in updates], axis=0, dtype=np.float64)
    assert norm64(total) <= 0.3 * len(updates)


@needs_bf16
def test_summary_precision_names_the_elementwise_kernels_that_ran(monkeypatch):
    """summary.json's `precision` of a recurrent bfloat16 cohort says which elementwise path ran
    (the C kernels, or torch ops and why); float32 and a non-recurrent trainer say nothing of it."""
    from dpfleet.coordinator.engine.backends import trainer_precision
    from dpfleet.edge import native_cell

    bf16 = CohortTrainer(CFG, seq_len=L, batch_size=BATCH, device="cpu", precision="bfloat16",
                         processes=False)
    assert trainer_precision(bf16)["elementwise"] == native_cell.cell().reason
    f32 = CohortTrainer(CFG, seq_len=L, batch_size=BATCH, device="cpu", precision="float32",
                        processes=False)
    assert "elementwise" not in trainer_precision(f32)
    monkeypatch.setattr(bf16, "device", torch.device("cuda"))  # what a CUDA cohort would state
    assert trainer_precision(bf16)["elementwise"].startswith("torch ops")


@needs_bf16
def test_bfloat16_cohort_runs_its_gemms_in_bfloat16_and_is_close_to_float32():
    """Same round at both precisions: different bits (the GEMMs ran in bfloat16), close deltas,
    and the same bits on a second bfloat16 run (reproducible at a precision)."""
    torch.manual_seed(0)
    theta = get_flat(build_model(CFG))
    rng = np.random.default_rng(2)
    examples = [rows(rng, n) for n in (5, 12, 8)]

    def run(precision):
        trainer = CohortTrainer(CFG, seq_len=L, batch_size=BATCH, device="cpu", chunk=2,
                                precision=precision, processes=False)
        return [u.delta for u in trainer.train_round(theta, examples, [1, 2, 3], lr=0.5,
                                                     batch_size=BATCH, clip_norm=10.0)]

    f32, bf16, again = run("float32"), run("bfloat16"), run("bfloat16")
    for a, b, c in zip(f32, bf16, again, strict=True):
        assert not np.array_equal(a, b)
        np.testing.assert_allclose(b, a, atol=2e-2 * np.abs(a).max())
        np.testing.assert_array_equal(b, c)


@needs_bf16
def test_public_training_at_bfloat16_is_close_to_float32_and_reproducible():
    """The public loop's GEMMs under bfloat16 autocast: not float32's bits, near them, the
    same bits twice; the weights it returns stay float32."""
    rng = np.random.default_rng(3)
    corpus = PlainCorpus([rng.integers(4, 64, rng.integers(4, 12)).tolist() for _ in range(20)])
    theta = get_flat(build_model(CFG))

    def run(precision):
        cfg = KDTrainConfig(steps=4, batch_size=4, lr=1e-2, beta=0.0, precision=precision)
        return kd_train(CFG, theta, corpus, None, cfg, progress=False)[0]

    f32, bf16, again = run("float32"), run("bfloat16"), run("bfloat16")
    assert bf16.dtype == np.float32 and not np.array_equal(bf16, f32)
    # Adam moves a weight by ~lr per step whatever its gradient's size, so a tiny gradient whose
    # sign bfloat16 rounding flips moves 2 lr: bounded by that, and rare
    off = np.abs(bf16 - f32)
    assert off.max() <= 2 * 4 * 1e-2 and (off > 1e-3).mean() < 0.02
    np.testing.assert_array_equal(bf16, again)


def test_bfloat16_on_a_cpu_without_it_is_one_error_line_and_no_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    config = tmp_path / "c.toml"
    config.write_text("rounds = 1\n[data]\ndataset = 'shakespeare'\nmax_clients = 20\nmax_examples = 8\n"
                      "eval_examples = 50\n[model]\nembedding_dim = 8\nhidden_dim = 8\nprojection_dim = 8\n"
                      "[client]\nprecision = 'bfloat16'\n[dp]\nreport_goal = 4\nnoise_multiplier = 1.0\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", str(config), "--out", str(tmp_path / "run"), "--quiet"])
    assert exit_info.value.code != 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert err == ["error: client.precision = 'bfloat16' but this CPU has no native BF16 (torch runs its "
                   "portable kernels, ATEN_CPU_CAPABILITY=default); use 'auto' or 'float32'"]
    assert not (tmp_path / "run").exists()  # refused before the run folder is made


@pytest.mark.parametrize("feature", ["AMX-BF16", None])
def test_auto_keeps_float32_for_a_small_model_and_bfloat16_for_a_large_one(feature, monkeypatch):
    """On a CPU with BF16 (simulated) "auto" is bfloat16 from AUTO_BF16_MIN_PARAMS parameters up
    and float32 below (the main job's 81,088-parameter CIFG ran no faster in bfloat16), saying why;
    without BF16 float32 at any size. An explicit "bfloat16" is not overruled by the size."""
    from dpfleet.edge import precision as precision_mod

    monkeypatch.setattr(precision_mod, "native_bf16", lambda: feature)
    assert precision_mod.AUTO_BF16_MIN_PARAMS == 2**18
    small = resolve_precision("auto", params=81_088)
    large = resolve_precision("auto", params=2**18)
    assert small.name == "float32"
    if feature is None:
        assert large.name == "float32"
        return
    assert small.reason == ("auto: CPU has AMX-BF16, but the model's 81,088 parameters are under "
                            "262,144: its GEMMs ran no faster in bfloat16")
    assert (large.name, large.reason) == ("bfloat16", "auto: CPU has AMX-BF16")
    assert resolve_precision("bfloat16", params=81_088).name == "bfloat16"
    assert resolve_precision("auto").name == "bfloat16"  # no size given (a teacher): the CPU rule


def test_auto_cohort_trainer_reads_its_model_size(monkeypatch):
    """The cohort trainer passes its model's parameter count: a tiny CIFG trains float32 under
    "auto" on a CPU with BF16 (simulated), a Gboard-size one bfloat16."""
    from dpfleet.edge import precision as precision_mod

    monkeypatch.setattr(precision_mod, "native_bf16", lambda: "AMX-BF16")
    tiny = CohortTrainer(CFG, seq_len=L, batch_size=BATCH, device="cpu", precision="auto", processes=False)
    assert tiny.precision.name == "float32" and "parameters are under" in tiny.precision.reason
    big_cfg = ModelConfig(arch="cifg", vocab_size=10_000, embedding_dim=96, hidden_dim=670,
                          projection_dim=96, tie_embeddings=True)  # the gboard_cifg preset
    big = CohortTrainer(big_cfg, seq_len=L, batch_size=BATCH, device="cpu", precision="auto",
                        processes=False)
    assert big.precision.name == "bfloat16" and big.layout.total == 1_422_250
