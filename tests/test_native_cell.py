"""The fused C kernels of the bfloat16 recurrent cohort (edge/lstm_cell.c) against torch in float64.

Tolerances: the kernels' exp is a polynomial (relative error ~1e-7), so float32 outputs are checked
to 2e-6; bfloat16 outputs to one bfloat16 rounding (2^-8 relative) plus 1e-6. A diverged client's
NaN must stay NaN (a kernel that clamped it into a finite value would hide the divergence from
the clipping and the loss), and a tensor whose layout the C loops do not index must be refused,
not written out of bounds.
"""

import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dpfleet.edge import native_cell
from dpfleet.edge.native_cell import cell, library_name, load

pytestmark = pytest.mark.skipif(cell().lib is None, reason=cell().reason)
BF16_RTOL = 2.0**-8


def _bf16(*shape, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).bfloat16()


def _reference_forward(pre, c_prev, coupled, hidden):
    o, f = torch.sigmoid(pre[..., :hidden]), torch.sigmoid(pre[..., hidden:2 * hidden])
    g = torch.tanh(pre[..., -hidden:])
    if coupled:
        c = g + f * (c_prev - g)
        acts = torch.cat([o, f, g], -1)
    else:
        i = torch.sigmoid(pre[..., 2 * hidden:3 * hidden])
        c = f * c_prev + i * g
        acts = torch.cat([o, f, i, g], -1)
    return acts, c, torch.tanh(c), o * torch.tanh(c)


@pytest.mark.parametrize("coupled", [True, False])
def test_forward_step_is_the_cell(coupled):
    k, rows, hidden = 3, 5, 37  # 37: loop tails that are not a multiple of the vector width
    gates = (3 if coupled else 4) * hidden
    x_pre, rec = _bf16(k, rows, gates, scale=3, seed=1), _bf16(k, rows, gates, scale=3, seed=2)
    c_prev = torch.randn(k, rows, hidden, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(k, gates, generator=torch.Generator().manual_seed(4))  # each client's own
    a = torch.empty(k, rows, gates)
    c, tc = (torch.empty(k, rows, hidden) for _ in range(2))
    m_low = torch.empty(k, rows, hidden, dtype=torch.bfloat16)
    cell().forward(x_pre, rec, bias, a, c_prev, c, tc, m_low, coupled)
    pre = x_pre.double() + rec.double() + bias.double().unsqueeze(1)
    want = _reference_forward(pre, c_prev.double(), coupled, hidden)
    for got, ref in zip((a, c, tc), want[:3], strict=True):
        torch.testing.assert_close(got.double(), ref, rtol=0, atol=2e-6)
    torch.testing.assert_close(m_low.double(), want[3], rtol=BF16_RTOL, atol=1e-6)


@pytest.mark.parametrize("coupled", [True, False])
def test_backward_step_is_the_cells_derivative(coupled):
    """dz and the carried dc against autograd through the reference cell, in float64."""
    k, rows, hidden = 2, 4, 21
    gates = (3 if coupled else 4) * hidden
    pre = (torch.randn(k, rows, gates, dtype=torch.float64) * 2).requires_grad_()
    c_prev = torch.randn(k, rows, hidden, dtype=torch.float64).requires_grad_()
    acts, c, tc, m = _reference_forward(pre, c_prev, coupled, hidden)
    dm = torch.randn(k, rows, hidden, dtype=torch.float64).bfloat16().double()  # the kernel takes bfloat16
    dc_next = torch.randn(k, rows, hidden, dtype=torch.float64)
    (m * dm + c * dc_next).sum().backward()  # dc_next: dL/dc_t from later steps
    dc = dc_next.float().clone()
    dz = torch.empty(k, rows, gates, dtype=torch.bfloat16)
    cell().backward(dm.bfloat16(), acts.detach().float(), tc.detach().float(), c_prev.detach().float(),
                    dc, dz, coupled)
    torch.testing.assert_close(dz.double(), pre.grad, rtol=BF16_RTOL, atol=1e-5)
    torch.testing.assert_close(dc.double(), c_prev.grad, rtol=0, atol=1e-5)


def test_a_nan_pre_activation_stays_nan():
    k, rows, hidden = 1, 2, 16
    x_pre = _bf16(k, rows, 3 * hidden)
    x_pre[0, 1, 5] = float("nan")  # the o gate of row 1
    a, (c, tc) = torch.empty(k, rows, 3 * hidden), (torch.empty(k, rows, hidden) for _ in range(2))
    m = torch.empty(k, rows, hidden, dtype=torch.bfloat16)
    cell().forward(x_pre, torch.zeros_like(x_pre), torch.zeros(k, 3 * hidden), a,
                   torch.zeros(k, rows, hidden), c, tc, m, True)
    assert torch.isnan(a[0, 1, 5]) and torch.isnan(m[0, 1, 5])
    assert torch.isfinite(m[0, 0]).all()


def _reference_xent(logits, bias, target, weight):
    x = logits.double() + bias.double().unsqueeze(1)
    logp = torch.log_softmax(x, -1)
    m, n, vocab = x.shape
    nll = -logp.reshape(m * n, vocab).gather(1, target).view(-1)
    grad = logp.exp().reshape(m * n, vocab)
    grad[torch.arange(m * n), target[:, 0]] -= 1.0
    bias_grad = (grad * weight.double()).view(m, n, vocab).sum(1)
    return nll, grad.view(m, n, vocab), bias_grad


def test_softmax_cross_entropy_is_log_softmax():
    """Two clients, the second's last row a fill row (weight 0), and a target whose probability
    underflows float32 (its logit 120 below the rest): its loss is still exact."""
    m, n, vocab = 2, 3, 1037
    logits = _bf16(m, n, vocab, scale=4, seed=5)
    bias = torch.randn(m, vocab, generator=torch.Generator().manual_seed(6))
    target = torch.tensor([[3], [1036], [0], [500], [7], [0]])
    logits[0, 2, 0] = -120.0
    weight = torch.tensor([[1 / 3]] * 3 + [[0.5], [0.5], [0.0]])
    grad = torch.empty(m, n, vocab, dtype=torch.bfloat16)
    nll, bias_grad = cell().softmax_xent(logits, bias, target, weight, grad)
    want_nll, want_grad, want_bias = _reference_xent(logits, bias, target, weight)
    assert want_nll[2] > 110  # the underflowing row
    torch.testing.assert_close(nll.double(), want_nll, rtol=1e-6, atol=2e-5)
    torch.testing.assert_close(grad.double(), want_grad, rtol=BF16_RTOL, atol=1e-6)
    torch.testing.assert_close(bias_grad.double(), want_bias, rtol=1e-5, atol=1e-6)


def test_a_nan_logit_makes_its_row_nan_only():
    logits = _bf16(1, 2, 64)
    logits[0, 0, 9] = float("nan")
    grad = torch.empty(1, 2, 64, dtype=torch.bfloat16)
    nll, _ = cell().softmax_xent(logits, torch.zeros(1, 64), torch.tensor([[1], [2]]),
                                 torch.full((2, 1), 0.5), grad)
    assert torch.isnan(nll[0]) and torch.isnan(grad[0, 0]).all()
    assert torch.isfinite(nll[1]) and torch.isfinite(grad[0, 1]).all()


def test_axpy_adds_a_bfloat16_gradient_into_float32_views():
    dst = torch.randn(3, 10, 40, dtype=torch.float64).float()
    src = _bf16(3, 10, 40, seed=8)
    view_dst, view_src = dst[:, 2:7, 5:30], src[:, 1:6, 0:25]  # strided rows and clients
    want = dst.double().clone()
    want[:, 2:7, 5:30] += -0.25 * view_src.double()
    cell().axpy(view_dst, view_src, -0.25)
    torch.testing.assert_close(dst.double(), want, rtol=1e-6, atol=1e-7)


def test_layouts_the_loops_do_not_index_are_refused():
    k, rows, hidden = 2, 3, 8
    ok = dict(x_pre=_bf16(k, rows, 24), rec=_bf16(k, rows, 24), bias=torch.zeros(k, 24),
              a=torch.empty(k, rows, 24),
              c_prev=torch.zeros(k, rows, hidden), c=torch.empty(k, rows, hidden),
              tc=torch.empty(k, rows, hidden), m_low=torch.empty(k, rows, hidden, dtype=torch.bfloat16))
    bad = [("a", torch.empty(k, 24, rows).transpose(1, 2)),  # columns not contiguous
           ("c", torch.empty(k, rows, 2 * hidden)[..., ::2]),
           ("x_pre", _bf16(k, rows, 24).float()),  # wrong dtype
           ("bias", torch.zeros(k + 1, 24)),  # one client too many
           ("m_low", torch.empty(k, rows + 1, hidden, dtype=torch.bfloat16))]  # wrong shape
    for name, tensor in bad:
        with pytest.raises(ValueError, match="native cell"):
            cell().forward(**{**ok, name: tensor}, coupled=True)
    with pytest.raises(ValueError, match="target range"):
        cell().softmax_xent(_bf16(1, 1, 8), torch.zeros(1, 8), torch.tensor([[8]]),
                            torch.ones(1, 1), torch.empty(1, 1, 8, dtype=torch.bfloat16))


def test_load_says_why_it_falls_back_and_caches_the_library(tmp_path, monkeypatch):
    assert load({"DPFLEET_NATIVE": "0"}).lib is None
    missing = load({"CC": str(tmp_path / "no-such-cc")})
    assert missing.lib is None and "no C compiler" in missing.reason
    failing = tmp_path / "failing-cc"
    failing.write_text("#!/bin/sh\necho 'cc: error: no such target' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("DPFLEET_CACHE", str(tmp_path / "cache"))
    broken = load({"CC": str(failing)})
    assert broken.lib is None and "did not build" in broken.reason and "no such target" in broken.reason
    env = {"PATH": os.environ["PATH"]}
    first = load(env)
    (built,) = (tmp_path / "cache" / "kernels").glob("lstm_cell-*.so")
    stamp = built.stat().st_mtime_ns
    assert first.lib is not None and load(env).lib is not None
    assert built.stat().st_mtime_ns == stamp  # loaded from the cache, not rebuilt


def test_a_library_planted_in_a_cache_others_can_write_is_never_loaded(tmp_path, monkeypatch):
    """Attack: another user plants a library under the exact cached name in a shared, world-
    writable cache folder; its constructor would run as us. The loader builds its own in a private
    folder instead: the planted constructor never runs, and the kernel still works."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    shared, marker = tmp_path / "cache" / "kernels", tmp_path / "planted-code-ran"
    shared.mkdir(parents=True)
    shared.chmod(0o777)
    monkeypatch.setenv("DPFLEET_CACHE", str(tmp_path / "cache"))
    planted = _plant(compiler, shared / library_name(compiler), marker)
    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setattr(native_cell.tempfile, "tempdir", str(private))
    loaded = load({})
    assert not marker.exists()
    assert loaded.lib is not None and list(private.iterdir()) == []  # no private folder left
    x = torch.randn(33)  # and the loaded library still runs
    assert torch.equal(loaded.to_bf16(x).view(torch.int16), x.bfloat16().view(torch.int16))
    ctypes.CDLL(str(planted))  # the control: loading the planted file does run its code
    assert marker.exists()


def _plant(compiler: str, path: Path, marker: Path) -> Path:
    """A library at `path` whose constructor creates `marker` (the attacker's code)."""
    evil = path.parent / "evil.c"
    evil.write_text('#include <stdio.h>\n__attribute__((constructor)) static void run(void) '
                    f'{{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n')
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(path), str(evil)], check=True)
    return path


# the loader in a fresh process (dlopen returns a library already loaded under the same name, so
# in this process an earlier load could stand in for the one under test), the adversary acting
# right after `_private_dir`'s check: a link to their folder in the checked folder's place, or a
# link to their library under the cached name
SWAP = """
import json, sys, tempfile
from pathlib import Path
import torch
from dpfleet.edge import native_cell
swap, theirs, name, moved, private = sys.argv[1:]
check = native_cell._private_dir
def check_then_swap(path):
    out = check(path)
    if swap == "folder":
        path.rename(moved)
        path.symlink_to(theirs)
    else:
        (path / name).symlink_to(Path(theirs) / name)
    return out
native_cell._private_dir = check_then_swap
tempfile.tempdir = private
loaded = native_cell.load({})
x = torch.randn(33)
same = loaded.lib is not None and torch.equal(loaded.to_bf16(x).view(torch.int16),
                                              x.bfloat16().view(torch.int16))
print(json.dumps({"runs": bool(same), "reason": loaded.reason}))
"""


@pytest.mark.parametrize("swap", ["folder", "library"])
def test_a_cache_swapped_after_its_check_is_never_loaded_from(tmp_path, swap):
    """Attack on the window between the cache folder's ownership check and dlopen (`SWAP`). The
    loader opens the folder without following links, checks the open folder and the library, and
    loads through that descriptor, so it builds its own in a private folder: the planted
    constructor never runs, and the kernel still works."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    theirs, marker, private = tmp_path / "theirs", tmp_path / "planted-code-ran", tmp_path / "tmp"
    theirs.mkdir()
    private.mkdir()
    name = library_name(compiler)
    planted = _plant(compiler, theirs / name, marker)
    env = {**os.environ, "DPFLEET_CACHE": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", SWAP, swap, str(theirs), name, str(tmp_path / "moved"),
                          str(private)], env=env, capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert not marker.exists()
    assert result["runs"] and list(private.iterdir()) == [], result
    ctypes.CDLL(str(planted))  # the control: loading the planted file does run its code
    assert marker.exists()


def test_the_cast_rounds_as_torch_does():
    """Round to nearest even, ties included, and inf kept: the same bits as torch's cast; NaN stays
    a NaN (its payload bits may differ: torch's vectorized cast writes 0xFFFF)."""
    x = torch.randn(10_007) * 1e3
    x[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0 + 2.0**-8])  # a tie
    got = cell().to_bf16(x)
    assert torch.isnan(got[0])
    assert torch.equal(got[1:].view(torch.int16), x[1:].bfloat16().view(torch.int16))
