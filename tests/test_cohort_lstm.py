"""The hand-written recurrent cohort step equals autograd (torch.func), minibatch by minibatch.

Tolerance: gradients within 1e-6 absolute (measured ~3e-8: the regrouped sums round differently),
mean losses within 1e-5 (measured <= 1e-6 on losses ~4). End to end against the sequential eager
path the tolerances of tests/test_edge_cohort.py apply.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_edge_cohort import BATCH, L, assert_same, both, client_rows
from torch.func import functional_call, grad_and_value, vmap

from dpfleet.edge import cohort as cohort_mod
from dpfleet.edge.cohort_lstm import recurrent_grads
from dpfleet.edge.tokenizer import PAD
from dpfleet.export.models import ModelConfig, build_model, next_token_loss

VOCAB = 64


def cfg_of(arch: str, tie: bool, layers: int) -> ModelConfig:
    return ModelConfig(arch=arch, vocab_size=VOCAB, embedding_dim=16, hidden_dim=24,
                       projection_dim=16, num_layers=layers, tie_embeddings=tie)


def stacked(cfg: ModelConfig, k: int, seed: int) -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(seed)
    models = [build_model(cfg) for _ in range(k)]
    names = [n for n, _ in models[0].named_parameters()]
    params = {n: torch.stack([dict(m.named_parameters())[n].detach() for m in models]) for n in names}
    return models[0], params


def rows_block(rng: np.random.Generator, k: int, b: int, lengths_max: int = L) -> torch.Tensor:
    """[k, b, L+1] BOS rows of random real length <= lengths_max (0: an all-PAD target row)."""
    rows = rng.integers(4, VOCAB, (k, b, L + 1))
    rows[:, :, 0] = 1
    lengths = rng.integers(0, lengths_max + 1, (k, b))
    for j in range(k):
        for r in range(b):
            rows[j, r, 1 + lengths[j, r]:] = PAD
    return torch.from_numpy(rows)


def autograd(model, params, rows):
    def loss(p, r):
        return next_token_loss(functional_call(model, p, (r[:, :-1],)), r[:, 1:], PAD)
    return vmap(grad_and_value(loss))(params, rows)


def assert_grads_close(ref, got, ref_loss, got_loss):
    assert sorted(ref) == sorted(got)
    for name in ref:
        np.testing.assert_allclose(got[name].numpy(), ref[name].numpy(), rtol=0, atol=1e-6,
                                   err_msg=name)
    np.testing.assert_allclose(got_loss.numpy(), ref_loss.numpy(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ["lstm", "cifg"])
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("layers", [1, 2])
def test_fused_grads_equal_autograd(arch, tie, layers):
    cfg = cfg_of(arch, tie, layers)
    model, params = stacked(cfg, k=4, seed=layers)
    rows = rows_block(np.random.default_rng(7), 4, 5)
    rows[3, :, 1:] = PAD  # a client with no real target: loss 0, zero gradient
    rows[:, 2, 1:] = PAD  # an all-PAD row in every client (a short last minibatch's filler)
    ref, ref_loss = autograd(model, params, rows)
    got, loss = recurrent_grads(cfg, params, rows)
    assert_grads_close(ref, got, ref_loss, loss)
    assert float(loss[3]) == 0.0 and all(not g[3].any() for g in got.values())
    assert all(g[0].abs().max() > 1e-6 for g in got.values())  # the others really train


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), k=st.integers(1, 4), b=st.integers(1, 6),
       longest=st.integers(0, L), arch=st.sampled_from(["lstm", "cifg"]))
def test_property_fused_equals_autograd_on_ragged_blocks(seed, k, b, longest, arch):
    """Any row lengths, including blocks whose trailing columns are all PAD (they are cut off)."""
    cfg = cfg_of(arch, tie=False, layers=1)
    model, params = stacked(cfg, k, seed % 1000)
    rows = rows_block(np.random.default_rng(seed), k, b, lengths_max=longest)
    ref, ref_loss = autograd(model, params, rows)
    got, loss = recurrent_grads(cfg, params, rows)
    assert_grads_close(ref, got, ref_loss, loss)


@pytest.mark.parametrize("tie", [False, True])
def test_underflowed_target_probability_still_gives_the_exact_loss(tie):
    """An output bias of -100 on some words pushes their softmax probability below 1e-30 (nll
    ~100): the kernel's loss there must be the log-sum-exp value autograd gets, not log(0) = inf
    or a value off by the denormal's rounding. Losses ~10-20 (float32's ulp ~2e-6): the loss
    check adds a relative 1e-6; the gradients keep the absolute 1e-6."""
    cfg = cfg_of("cifg", tie, layers=1)
    model, params = stacked(cfg, k=3, seed=5)
    bias = "output_bias" if tie else "output.bias"
    params[bias][:, 4:12] = -100.0
    rows = rows_block(np.random.default_rng(3), 3, 4)
    ref, ref_loss = autograd(model, params, rows)
    logp = torch.stack([functional_call(model, {n: p[j] for n, p in params.items()}, (rows[j, :, :-1],))
                        for j in range(3)]).log_softmax(-1)
    logp_t = logp.gather(-1, rows[:, :, 1:, None])[rows[:, :, 1:] != PAD]
    assert float(logp_t.min()) < -70.0  # some target really underflows (p_t < 1e-30)
    got, loss = recurrent_grads(cfg, params, rows)
    assert torch.isfinite(loss).all()
    np.testing.assert_allclose(loss.numpy(), ref_loss.numpy(), rtol=1e-6, atol=1e-5)
    for name in ref:
        np.testing.assert_allclose(got[name].numpy(), ref[name].numpy(), rtol=0, atol=1e-6,
                                   err_msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_client_gradient_depends_on_its_own_rows_only(dtype, bf16_kernels):
    """Attack on batching over clients: change client 1's rows; clients 0 and 2 keep their exact
    gradients while client 1's moves by far more than the tolerance. bfloat16 too: its output
    layer adds each client's bias and sums its bias gradient over that client's rows."""
    cfg = cfg_of("lstm", tie=True, layers=2)
    _, params = stacked(cfg, k=3, seed=0)
    rows = rows_block(np.random.default_rng(1), 3, 4)
    before, _ = recurrent_grads(cfg, params, rows, dtype=dtype)
    rows[1] = rows_block(np.random.default_rng(2), 1, 4)[0]
    after, _ = recurrent_grads(cfg, params, rows, dtype=dtype)
    for name in before:
        for j in (0, 2):
            np.testing.assert_allclose(after[name][j].numpy(), before[name][j].numpy(), rtol=0,
                                       atol=1e-7)
    assert max(float((after[n][1] - before[n][1]).abs().max()) for n in before) > 1e-2


def test_short_rows_are_trimmed_and_still_equal_the_sequential_path(monkeypatch):
    """Clients whose rows are all shorter than the row length: the blocks the cohort trains on
    are cut to the longest real row (seen by a spy), and the results equal the sequential path,
    which trains on full-width rows."""
    widths = []
    real = cohort_mod.recurrent_grads

    def spy(cfg, params, rows, **kwargs):
        widths.append(rows.shape[-1])
        return real(cfg, params, rows, **kwargs)

    monkeypatch.setattr(cohort_mod, "recurrent_grads", spy)
    rng = np.random.default_rng(5)
    examples = []
    for n in (11, 4, 20):
        rows = client_rows(rng, n)
        rows[:, 5:] = PAD  # at most 4 real targets per row
        examples.append(rows)
    seq, cohort = both("cifg", examples, [3, 4, 5], clip=0.3)
    assert_same(seq, cohort)
    assert widths and max(widths) <= 5 < L + 1


def test_client_without_real_targets_matches_the_sequential_path():
    rng = np.random.default_rng(6)
    empty = client_rows(rng, 6)
    empty[:, 1:] = PAD
    examples = [client_rows(rng, 13), empty, client_rows(rng, 3)]
    seq, cohort = both("lstm", examples, [1, 2, 3], clip=1.0, tie_embeddings=True, num_layers=2)
    assert_same(seq, cohort)
    assert not cohort[1].delta.any() and cohort[1].loss == 0.0
    assert cohort[0].delta.any() and cohort[2].delta.any()


def test_fused_chunk_memory_rule_is_smaller_per_client():
    """The fused path keeps vocabulary-sized logits one client at a time, so a client costs less
    and the same budget holds more clients."""
    big = ModelConfig(arch="lstm", vocab_size=4096, embedding_dim=96, hidden_dim=256,
                      projection_dim=96)
    plain = cohort_mod.bytes_per_client(big, 16, 20)
    fused = cohort_mod.bytes_per_client(big, 16, 20, fused=True)
    assert fused < plain / 2
    cpu = torch.device("cpu")
    assert cohort_mod.chunk_size(big, 16, 20, cpu, 160, fused=True) == 160 * 2**20 // fused
    assert BATCH == 8  # the shared helpers' batch (both() trains with it)


def test_chunks_on_two_threads_equal_the_sequential_path(monkeypatch):
    """2 torch threads: the round's chunks train on 2 Python threads (one torch thread each).
    Every client's update still equals the sequential path's, in the caller's order (a chunk's
    results written to another chunk's clients would miss by far more than the tolerance), the
    run repeats bit for bit, and torch's thread count is restored afterwards. Worker processes
    are the default since they exist (`cohort_pool`, whose tests show they give these threads'
    bits); here they are made unavailable, so the thread fallback runs."""
    calls = []
    real = cohort_mod._on_threads

    def spy(fn, items, workers):
        calls.append((len(items), workers))
        return real(fn, items, workers)

    monkeypatch.setattr(cohort_mod, "_on_threads", spy)
    monkeypatch.setattr(cohort_mod, "shared_pool", lambda size, preload="": None)
    rng = np.random.default_rng(9)
    examples = [client_rows(rng, n) for n in (1, 7, 13, 20, 4, 9, 16)]
    seeds = list(range(len(examples)))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seq, cohort = both("cifg", examples, seeds, clip=0.5)
        _, again = both("cifg", examples, seeds, clip=0.5)
        threads_after = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    assert calls == [(3, 2), (3, 2)]  # 7 clients in chunks of 3 on 2 threads, both runs
    assert threads_after == 2
    assert_same(seq, cohort)
    for a, b in zip(cohort, again, strict=True):
        np.testing.assert_array_equal(a.delta, b.delta)


# bfloat16 keeps 8 significant bits (unit roundoff 2^-9 = 2e-3); each gradient passes a few
# rounded GEMM operands and outputs and the recurrence carries them over 8 steps, so the
# stated tolerance is 2^-5 = 3.1% of each gradient's norm (measured 0.5% to 0.8%); the loss within 0.1%
# (measured 2e-5).
BF16_RTOL = 2**-5


@pytest.fixture(params=["fused", "torch-ops"])
def bf16_kernels(request, monkeypatch):
    """The bfloat16 path's elementwise work both ways: the C kernels (edge/lstm_cell.c) and the
    torch ops a machine without a C compiler runs."""
    from dpfleet.edge import cohort_lstm, native_cell

    if request.param == "fused" and native_cell.cell().lib is None:
        pytest.skip(native_cell.cell().reason)
    if request.param == "torch-ops":
        monkeypatch.setattr(cohort_lstm, "cell", lambda: native_cell.Cell(None, "torch ops: test"))
    return request.param


@pytest.mark.parametrize("arch", ["lstm", "cifg"])
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("layers", [1, 2])
def test_bfloat16_gemms_give_the_float32_gradients_within_bfloat16_rounding(arch, tie, layers,
                                                                            bf16_kernels):
    """The bfloat16 path's gradients (float32 tensors) against the float32 path's, per parameter
    and client: relative L2 error <= 2^-5, and not the same bits (the GEMMs did run in bfloat16)."""
    cfg = cfg_of(arch, tie, layers)
    _, params = stacked(cfg, k=3, seed=layers)
    rows = rows_block(np.random.default_rng(11), 3, 6)
    rows[:, 2, 1:] = PAD
    ref, ref_loss = recurrent_grads(cfg, params, rows)
    got, loss = recurrent_grads(cfg, params, rows, dtype=torch.bfloat16)
    assert sorted(got) == sorted(ref) and loss.dtype == torch.float32
    for name, g in got.items():
        assert g.dtype == torch.float32 and not torch.equal(g, ref[name]), name
        for j in range(3):
            err = float((g[j] - ref[name][j]).norm() / ref[name][j].norm())
            assert err <= BF16_RTOL, (name, j, err)
    np.testing.assert_allclose(loss.numpy(), ref_loss.numpy(), rtol=1e-3)


def test_bfloat16_sgd_step_keeps_float32_weights_near_the_float32_step(bf16_kernels):
    """With `lr` the SGD step is fused: the weights stay float32 and move as float32's do."""
    cfg = cfg_of("cifg", True, 1)
    _, start = stacked(cfg, k=2, seed=3)
    rows = rows_block(np.random.default_rng(12), 2, 4)
    f32 = {n: p.clone() for n, p in start.items()}
    bf16 = {n: p.clone() for n, p in start.items()}
    recurrent_grads(cfg, f32, rows, lr=0.5)
    recurrent_grads(cfg, bf16, rows, lr=0.5, dtype=torch.bfloat16)
    for name in start:
        assert bf16[name].dtype == torch.float32
        step_f, step_b = f32[name] - start[name], bf16[name] - start[name]
        assert float((step_b - step_f).norm() / step_f.norm()) <= BF16_RTOL, name


def test_bfloat16_loss_of_a_diverged_client_is_finite_and_near_float32(bf16_kernels):
    """A client whose targets underflow (its output bias ~ N(0, 200^2)): the bfloat16 path takes
    its loss by log-sum-exp (torch ops: from the rounded softmax; the C kernel: exact in float32),
    finite and within 1% of float32's, and its
    gradients (the output bias's included) stay within bfloat16 rounding of float32's."""
    cfg = cfg_of("cifg", True, 1)
    _, params = stacked(cfg, k=3, seed=5)
    params["output_bias"][1] = 200.0 * torch.randn(VOCAB, generator=torch.Generator().manual_seed(0))
    rows = rows_block(np.random.default_rng(13), 3, 5)
    ref, ref_loss = recurrent_grads(cfg, params, rows)
    got, loss = recurrent_grads(cfg, params, rows, dtype=torch.bfloat16)
    assert torch.isfinite(loss).all() and float(loss[1]) > 20
    np.testing.assert_allclose(loss.numpy(), ref_loss.numpy(), rtol=1e-2)
    for name, g in got.items():
        for j in range(3):
            err = float((g[j] - ref[name][j]).norm() / ref[name][j].norm())
            assert err <= BF16_RTOL, (name, j, err)


@pytest.mark.parametrize("coupled", [False, True])
def test_bfloat16_paths_local_derivatives_are_the_float32_paths(coupled):
    """The bfloat16 path's fewer-pass local derivatives are the same functions as float32's: equal
    in float64 to 1e-12 on random gates (a wrong sign, gate or time shift moves them by O(1))."""
    from dpfleet.edge.cohort_lstm import _local_derivatives, _local_derivatives_low

    torch.manual_seed(3)
    steps, k, rows, hidden = 5, 2, 3, 4
    n_gates = (3 if coupled else 4) * hidden
    acts = torch.rand(steps, k, rows, n_gates, dtype=torch.float64)
    cells = torch.randn(steps, k, rows, hidden, dtype=torch.float64)
    tanh_cells = torch.tanh(cells)
    want = _local_derivatives(acts, cells, tanh_cells, coupled)
    got = _local_derivatives_low(acts, cells, tanh_cells, coupled)
    for w, g in zip(want, got, strict=True):
        assert w.shape == g.shape
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


def test_the_bfloat16_path_runs_the_c_kernels_where_they_built(monkeypatch):
    """A spy on the kernels: every time step of every layer goes through the C cell forward and
    backward, every output group through the C softmax; float32 never calls them."""
    from dpfleet.edge import native_cell

    if native_cell.cell().lib is None:
        pytest.skip(native_cell.cell().reason)
    calls = {"forward": 0, "backward": 0, "softmax_xent": 0}
    for name in calls:
        real = getattr(native_cell.Cell, name)
        monkeypatch.setattr(native_cell.Cell, name,
                            lambda self, *a, _real=real, _name=name, **kw: (
                                calls.__setitem__(_name, calls[_name] + 1), _real(self, *a, **kw))[1])
    cfg = cfg_of("cifg", True, 2)
    _, params = stacked(cfg, k=2, seed=4)
    rows = rows_block(np.random.default_rng(14), 2, 3)
    recurrent_grads(cfg, params, rows)
    assert calls == {"forward": 0, "backward": 0, "softmax_xent": 0}
    recurrent_grads(cfg, params, rows, dtype=torch.bfloat16)
    steps = int((rows[:, :, 1:] != PAD).any(0).any(0).nonzero()[-1]) + 1
    assert calls["forward"] == calls["backward"] == 2 * steps and calls["softmax_xent"] >= 1
