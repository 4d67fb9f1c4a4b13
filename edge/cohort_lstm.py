"""Hand-written forward and backward of the zoo's recurrent LMs (LSTM, CIFG) for a cohort.

Why not autograd (`vmap(grad(...))`, the transformer's path in `cohort.py`): on the peer workload
a sequential step spends most of its time in ~100 small matmuls per step, because autograd
differentiates the unrolled time loop step by step; every step's weight gradient is a GEMM with
an inner dimension of only `batch` (16) rows. Here the same arithmetic is regrouped, exactly up
to float rounding:

* the weight gradients of the gates (with their bias) and of the projection are one GEMM each
  over all time steps after the backward recurrence;
* the gates' local derivatives (sigmoid', tanh', the cell's products) are computed for all time
  steps in a few whole-tensor ops, so the backward recurrence is 6 ops per time step;
* every matmul is batched over the client axis (`bmm`, client j uses only its own weights);
* trailing columns with no real target are cut off (a causal model's later positions cannot
  change earlier outputs), and the output layer, log-softmax and loss run only at real (non-PAD)
  target positions: each client's real positions are packed into the rows of one [k, n_max, P]
  block (n_max: the most real targets of any client), so the vocabulary-sized work is one batched
  GEMM over all clients (fill rows get weight 0);
* with `lr`, SGD is applied as each gradient is made (`_Sink`): no zero-filled gradient
  buffers, the embedding's only at the rows used. Each gradient is summed in full before it
  touches the weight (accumulating into the weight inside the GEMM, beta = 1, adds partial sums
  at the weight's scale: the peer workload's deltas then moved 1.5e-6 from the sequential path,
  against 4e-8 this way).

Per-step cost at one thread (issue 26; the peer workload has 20 time steps and often only 2-4
clients left in a chunk, so every op's fixed cost counts): the gate rows are reordered once per
call (o, f[, i], g) so the sigmoid gates are one op and the backward's dc-products one op per
step; the weights each step multiplies are contiguous copies made once (a transposed or sliced
weight view made `bmm` copy or loop: 71 vs 49 us per step at 20 clients); the input projection
is a per-step GEMM on [x_t, 1] (bias folded in) straight into the step's contiguous slice, with
h_{t-1} @ W_h added in place (the old hoisted projection cost a copy of its slice every step,
baddbmm's `self`); the per-step views come from one `unbind` each; the backward writes dz
client-major so the weight GEMMs need no transposed copy, and the gates' weight and bias gradients
are one GEMM on [h_{t-1}, x_t, 1]. The output layer folds its bias into the GEMMs (a ones column:
baddbmm copied the bias into every logit row, and the bias gradient was one more pass over the
softmax), makes [dW, db]^T in the faster [P+1, V] shape, and reuses one logits and one softmax
buffer for all its groups (fresh multi-MB tensors cost page faults: the logits GEMM ran 4x slower
into fresh pages). Where a target's probability underflows (clients that diverge at lr 5: most
of their targets), the loss takes log(sum) from the softmax at the row's top logit instead of a
second exp pass. The local derivatives are in-place chains (6 fresh [T, k, B, H] temporaries
instead of 9). Measured on the peer workload, 1 thread, load ~1, 5 runs paired with the previous
kernel (cba5108): 436 vs 310 steps/s (median pair ratio 1.40x); LSTM 96/256/96, vocab 4K, 9
clients: 116 vs 128 ms per step (1.10x). Rounding: against the sequential path the peer workload's
first round's per-client deltas are 4.5e-8 to 2.8e-7 off (before: 4.5e-8 to 1.8e-7; one 16-step
client that diverges amplifies either to ~1e-4).

bfloat16 (`recurrent_grads(dtype=torch.bfloat16)`, `client.precision` "bfloat16" or "auto" on a
CPU with native BF16): the same regrouped arithmetic with bfloat16 GEMM operands, not autocast
(which cast each GEMM's operands anew: at these sizes the casts cost what the faster GEMMs saved).
Every GEMM is bfloat16 (without the C kernels below, the per-step projection's, m_t W_p^T and
its backward, stays float32): the input projection of all steps (one GEMM with inner dimension D,
no bias column: 97 against 96 ran it 1.6x slower, and d_x's too; the float32 bias is added where
the pre-activations are summed), the per-step recurrent GEMMs (h_{t-1} W_h and dz_t W_h^T: their
operands are the casts the weight gradients' GEMMs take anyway, written as each step makes them;
the product is added to the float32 gates or dh), with the C kernels the per-step projection's
(m_t W_p^T from the cell's bfloat16 m_t, h_t rounded once; dh_t W_p from dh_t cast, dm_t rounded
once: 0.8x and 0.7x the float32 GEMMs' time), the gates' and projection's weight gradients, d_x,
and the output layer's three GEMMs with inner or outer dimension P (no bias column: 97 against 96
ran them up to 2.1x slower; the bias is added to the bfloat16 logits, its gradient a column
sum). The gate weights are cast once per call into two blocks, W_h and W_x, that every GEMM takes
as they are or as a transposed view (`_gate_weights`: the float32 path's transposed copies, cast
again, were 8% of a Gboard-size step), and the local
derivatives take 9 passes instead of 17 (`_local_derivatives_low`): 0.949x the time of the
previous bfloat16 kernel [0.921, 0.977] (150 in-process pairs, 6 Gboard-size clients, 1 thread;
the same bits but for the local derivatives' rounding). The backward writes dz in bfloat16 straight
from its float32 products (the same bits; no float32 dz of 31 MB; time 0.994x [0.955, 1.034]).
With the C kernels below, a step takes 0.736x the previous kernel's time [0.704, 0.769]
(`benchmarks/kernel_pairs.py`, 100 pairs); with the bias out of the input projection, the
projection's GEMMs in bfloat16 and the softmax's maximum vectorized, 0.961x that [0.932, 0.992]
(100 pairs, `benchmarks/results/kernel_pairs.json`).
Where the machine has a C compiler (`edge/native_cell.py`, `edge/lstm_cell.c`; float32 never
uses them) the elementwise work runs in fused C kernels instead: each step's cell forward (the two
bfloat16 pre-activations and the float32 bias summed, the gates, the cell, m in bfloat16: no
float32 copy of the input projection, no float32 `gated`), each step's backward with the local
derivatives made inline (no [T, k, B, H] derivative tensors), the output layer's bias, softmax,
loss, one-hot and bias gradient in one pass per row (the loss exact where the target's
probability underflows), and every bfloat16 gradient added into its float32 weight in one pass.
A bfloat16 GEMM accumulates in float32 and rounds its result once, to bfloat16 (torch on CPU has
no float32 output for it). The nonlinearities, cell state and local derivatives
stay float32 (mixed-dtype elementwise ops convert through a slow generic path), and so does the
SGD step on the float32 weights. The softmax runs on the bfloat16 logits in one op (float32 inside
each row, each probability rounded once; `_softmax_grad`). Gradients are within 2^-5 of float32's
(relative L2, tests/test_cohort_lstm.py). The output layer's weight gradient is made as [V, P]
there (in bfloat16 the transposed add of [P, V] cost more than its GEMM).

Gradients are those of each client's own mean next-token loss (`next_token_loss`): clients never
share a tensor row, so client j's gradient depends on client j's rows only (tested as an attack
in tests/test_cohort_lstm.py).
"""

from __future__ import annotations

import functools

import torch

from dpfleet.edge.native_cell import Cell, cell
from dpfleet.edge.tokenizer import PAD
from dpfleet.export.models import ModelConfig

RECURRENT = ("lstm", "cifg")
# logits per output-layer GEMM group (4 MB): one 9-client block of the peer workload's 4K-word
# logits (38 MB) ran its log-softmax 2x slower than 9 per-client blocks (fresh pages each call);
# with the buffers reused across groups 2**20 is still the fastest of 2**18 .. 2**21 (peer workload)
LOGITS_FLOATS = 2**20


def fused_bytes_per_client(cfg: ModelConfig, batch_size: int, seq_len: int, n_params: int) -> int:
    """Working memory of one client in a fused chunk (float32).

    Weights + gradient + update temporary (3 x params), and per token and layer the saved
    activations of the recurrence: input, gate pre-activations, activated gates and their
    gradient (3 x gates), cell, tanh(cell), gated output (3 x hidden), output and its gradient.
    (The logits are [chunk, real targets, vocab]; the budget's rule predates them and is kept so a
    config's chunks, hence its float rounding, do not change.)
    """
    gates = (3 if cfg.arch == "cifg" else 4) * cfg.hidden_dim
    per_token = cfg.num_layers * (cfg.embedding_dim + 3 * gates + 3 * cfg.hidden_dim
                                  + 2 * cfg.projection_dim)
    return 4 * (3 * n_params + batch_size * seq_len * per_token)


class _Sink:
    """Where a gradient goes: a zero-initialised gradient tensor (`lr` None) or, with `lr`, the
    parameter itself scaled by -lr (the SGD step fused into the gradient's GEMM). With `fused`, a
    bfloat16 gradient is added to its float32 target in one C pass (`Cell.axpy`)."""

    def __init__(self, params: dict[str, torch.Tensor], lr: float | None, fused: Cell | None = None):
        self.params, self.lr, self.fused = params, lr, fused
        self.grads = {} if lr is not None else {n: torch.zeros_like(p) for n, p in params.items()}

    def _axpy(self, target: torch.Tensor, value: torch.Tensor, alpha: float) -> None:
        if (self.fused is not None and value.dtype == torch.bfloat16 and target.dtype == torch.float32
                and value.dim() <= 3 and value.stride(-1) == 1 and target.stride(-1) == 1):
            self.fused.axpy(target, value, alpha)
        else:
            target.add_(value, alpha=alpha)

    def target(self, name: str) -> tuple[torch.Tensor, float]:
        if self.lr is not None:
            return self.params[name], -self.lr
        return self.grads[name], 1.0

    def add(self, parts: list[tuple[str, tuple, torch.Tensor]], clients: slice = slice(None)) -> None:
        """gradient[name][clients][index] += value for each (name, index, value), or the SGD step."""
        for name, index, value in parts:
            target, alpha = self.target(name)
            self._axpy(target[clients][index], value, alpha)

    def gemm(self, name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        """gradient += a @ b (batched), or the SGD step with it (a bfloat16 product is summed in
        float32 inside the GEMM, rounded once, and added to the float32 gradient or weight)."""
        target, alpha = self.target(name)
        if self.lr is None and a.dtype == target.dtype:
            target.baddbmm_(a, b)
        elif self.lr is None:
            self._axpy(target, torch.bmm(a, b), 1.0)
        elif a.dtype == target.dtype:
            target.sub_(torch.bmm(a, b), alpha=self.lr)
        else:
            self._axpy(target, torch.bmm(a, b), alpha)


def _gate_order(t: torch.Tensor, hidden: int) -> torch.Tensor:
    """Gate rows (dim 1) from the weights' order (f[, i], g, o) to the kernel's (o, f[, i], g):
    the sigmoid gates side by side (one sigmoid per time step), and side by side the gates whose
    gradient is dc_t times a local derivative (one product per time step in the backward)."""
    return torch.cat([t[:, -hidden:], t[:, :-hidden]], 1)


def _dense(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous copy of `t` in `dtype` (the cast and the copy in one pass). A cast runs first
    in `t`'s own memory order and then the copy to contiguous: a transposed view's strided copy
    with the cast in it ran 2x slower than the two (the input projection's [W_x, b]^T at the
    Gboard size, paired); the same floats either way."""
    if dtype != t.dtype:
        return t.to(dtype).contiguous()
    return torch.empty(t.shape, dtype=dtype, device=t.device).copy_(t)


def _gate_weights(w: torch.Tensor, b: torch.Tensor, hidden: int, proj: int,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W_h [k, G, P] and W_x [k, G, D] in the kernel's gate order, cast to `dtype` in one pass
    each, and the bias [k, G] in that order (float32: added where the pre-activations are summed,
    not a GEMM's ones column, which made its inner dimension D + 1: 97 against 96 ran the input
    projection 1.6x slower at the Gboard size, and d_x's outer one too). Every GEMM of the layer
    takes W_h or W_x or its transposed view (torch's `bmm` takes a contiguous or
    transposed-contiguous operand as it is; a column slice it copies), so the weights are cast
    once per call and never copied into transposed layouts."""
    k, n_gates, width = w.shape
    d = width - proj
    w_h = w.new_empty(k, n_gates, proj, dtype=dtype)
    w_x = w.new_empty(k, n_gates, d, dtype=dtype)
    bias = torch.empty_like(b)
    for dst, src in ((slice(0, hidden), slice(-hidden, None)), (slice(hidden, None), slice(0, -hidden))):
        w_h[:, dst] = w[:, src, d:]
        w_x[:, dst] = w[:, src, :d]
        bias[:, dst] = b[:, src]
    return w_h, w_x, bias


def _layer_weights(w: torch.Tensor, b: torch.Tensor, hidden: int, proj: int,
                   low: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, tuple, torch.Tensor | None]:
    """The gate weights as the layer's GEMMs take them: the input projection's (float32:
    [W_x, b]^T [k, D+1, G], the bias folded in; bfloat16: W_x^T [k, D, G]) and W_h^T [k, P, G]
    for the forward, (W_x [k, G, D], W_h [k, G, P]) for the backward, and the bias [k, G] in the
    kernel's gate order where it is not folded (bfloat16), else None. float32: contiguous copies
    in the kernel's gate order; bfloat16: views of one cast (`_gate_weights`)."""
    d = w.shape[2] - proj
    if low != torch.float32:
        w_h, w_x, bias = _gate_weights(w, b, hidden, proj, low)
        return w_x.transpose(1, 2), w_h.transpose(1, 2), (w_x, w_h), bias
    w_k, b_k = _gate_order(w, hidden), _gate_order(b.unsqueeze(2), hidden)
    wx = _dense(torch.cat([w_k[:, :, :d], b_k], 2).transpose(1, 2), low)
    wh = w_k[:, :, d:].transpose(1, 2).contiguous()
    return wx, wh, (w_k[:, :, :d], _dense(wh.transpose(1, 2), low)), None


def _layer_forward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, wp: torch.Tensor,
                   coupled: bool, low: torch.dtype = torch.float32,
                   fused: Cell | None = None) -> tuple[torch.Tensor, tuple]:
    """x [k, T, B, D] (client-major) -> outputs [T, k, B, P] (time-major) and what backward needs.

    Each step's gates are two batched GEMMs, [x_t, 1] @ [W_x, b]^T and h_{t-1} @ W_h^T added in
    place, into the time step's slice of a time-major buffer: contiguous results and contiguous
    (copied once) weights, else torch copies or loops over the clients with one GEMM each.
    `low` bfloat16: the input projection of all steps is one bfloat16 GEMM copied into the float32
    gates, each step adds its float32 recurrent GEMM in place; the saved GEMM operands (inputs,
    gated outputs) are bfloat16 for the weight gradients' GEMMs. `fused`: each step's elementwise
    work is one call of the C cell (`edge/native_cell.py`) instead of five torch ops."""
    k, steps, rows, d = x.shape
    n_gates, hidden, proj = w.shape[1], wp.shape[2], wp.shape[1]
    hoisted = low != torch.float32
    # [h_{t-1}, x_t, 1] for every step, client-major: the rows of the weight gradient's GEMM
    inputs = x.new_empty(k, steps, rows, proj + d + 1, dtype=low)
    inputs[..., proj:proj + d] = x
    inputs[..., -1] = 1.0
    wx, wh, back, bias = _layer_weights(w, b, hidden, proj, low)
    wp_t, wp_low = _projection_weights(wp, low, fused)
    acts = x.new_empty(steps, k, rows, n_gates, dtype=torch.float32)
    if hoisted:  # a GEMM's output is its operands' dtype: the input projection of all steps in one
        # GEMM (no bias column), copied to float32 with the bias added; each step adds its
        # recurrent GEMM in float32 (`fused`: the cell sums all three)
        x_proj = torch.bmm(inputs[..., proj:proj + d].view(k, steps * rows, d), wx)
        if fused is None:
            acts.copy_(x_proj.view(k, steps, rows, n_gates).transpose(0, 1)).add_(bias.view(1, k, 1, -1))
    cells = x.new_empty(steps, k, rows, hidden, dtype=torch.float32)
    tanh_cells = torch.empty_like(cells)
    # client-major: the projection's weight gradient (`fused`: written in bfloat16 by the cell; the
    # projection's GEMM of each step takes it too, its product h_t rounded once to bfloat16)
    gated = x.new_empty(k, steps, rows, hidden, dtype=low if fused is not None else torch.float32)
    out = x.new_empty(steps, k, rows, proj)
    if fused is not None:
        _fused_steps(x_proj.view(k, steps, rows, n_gates), inputs[..., :proj], bias, wh, wp_t, acts, cells,
                     tanh_cells, gated, out, coupled, fused)
        inputs[:, 0, :, :proj] = 0.0
        return out, (inputs, acts, cells, tanh_cells, gated, *back, wp_low)
    # per-step views made once (one unbind call instead of a slice per step and view)
    xs, a_s = inputs[..., proj:].unbind(1), acts.unbind(0)
    sigs, gs = acts[..., :-hidden].unbind(0), acts[..., -hidden:].unbind(0)
    os_, fs = acts[..., :hidden].unbind(0), acts[..., hidden:2 * hidden].unbind(0)
    i_s = acts[..., 2 * hidden:3 * hidden].unbind(0)
    cs, tcs, ms, hs = cells.unbind(0), tanh_cells.unbind(0), gated.unbind(1), out.unbind(0)
    # bfloat16: h_{t-1} @ W_h in bfloat16 too (h_{t-1} is cast into `inputs` as it is made, where the
    # weight gradient's GEMM reads it; the product is added to the float32 gates): 0.5x the time
    # of the float32 GEMM with the cast and the add
    h_low = inputs[..., :proj].unbind(1)
    product = x.new_empty(k, rows, n_gates, dtype=low) if hoisted else None
    for t in range(steps):
        # activated in place: acts holds the gates
        a = a_s[t] if hoisted else torch.bmm(xs[t], wx, out=a_s[t])
        if t and hoisted:
            a.add_(torch.bmm(h_low[t], wh, out=product))
        elif t:
            a.baddbmm_(hs[t - 1], wh)
        sigs[t].sigmoid_()
        g = gs[t].tanh_()
        f, c = fs[t], cs[t]
        if coupled:  # c = f c' + (1 - f) g = g + f (c' - g)
            if t:
                torch.addcmul(g, f, cs[t - 1] - g, out=c)
            else:
                torch.addcmul(g, f, g, value=-1.0, out=c)
        else:  # c = f c' + i g
            torch.mul(i_s[t], g, out=c)
            if t:
                c.addcmul_(f, cs[t - 1])
        m = torch.mul(os_[t], torch.tanh(c, out=tcs[t]), out=ms[t])
        torch.bmm(m, wp_t, out=hs[t])
        if hoisted and t + 1 < steps:
            h_low[t + 1].copy_(hs[t])
    inputs[:, 0, :, :proj] = 0.0
    if not hoisted:
        inputs[:, 1:, :, :proj] = out[:-1].transpose(0, 1)
    return out, (inputs, acts, cells, tanh_cells, gated.to(low), *back, wp_low)


def _projection_weights(wp: torch.Tensor, low: torch.dtype,
                        fused: Cell | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(W_p^T [k, H, P] as the forward's GEMM takes it, the bfloat16 W_p [k, P, H] or None):
    `fused`, one bfloat16 cast that both directions' GEMMs take (the forward its transposed
    view); else a float32 copy of W_p^T."""
    if fused is None:
        return wp.transpose(1, 2).contiguous(), None
    wp_low = fused.to_bf16(wp) if wp.is_contiguous() else _dense(wp, low)
    return wp_low.transpose(1, 2), wp_low


def _fused_steps(x_proj: torch.Tensor, h_low: torch.Tensor, bias: torch.Tensor, wh: torch.Tensor,
                 wp_t: torch.Tensor, acts: torch.Tensor, cells: torch.Tensor, tanh_cells: torch.Tensor,
                 gated: torch.Tensor, out: torch.Tensor, coupled: bool, fused: Cell) -> None:
    """`_layer_forward`'s recurrence with the C cell: per step the recurrent GEMM h_{t-1} W_h^T
    (bfloat16, into `product`), one cell call (x_pre + rec + bias -> gates in `acts`, c, tanh c,
    m in bfloat16 into `gated`) and the projection's bfloat16 GEMM m_t W_p^T, whose product h_t
    goes to `out` (float32) and, cast, to the next step's rows of `h_low` (`inputs`' h columns)."""
    steps, k, rows, hidden = cells.shape
    x_steps, h_lows = x_proj.unbind(1), h_low.unbind(1)
    cs, tcs, ms, hs = cells.unbind(0), tanh_cells.unbind(0), gated.unbind(1), out.unbind(0)
    zeros = cells.new_zeros(k, rows, hidden)  # c_{-1}
    product = x_proj.new_zeros(k, rows, acts.shape[-1])  # the recurrent product at t = 0
    h_step = x_proj.new_empty(k, rows, out.shape[-1])
    for t in range(steps):
        rec = torch.bmm(h_lows[t], wh, out=product) if t else product
        c_prev = cs[t - 1] if t else zeros
        fused.forward(x_steps[t], rec, bias, acts[t], c_prev, cs[t], tcs[t], ms[t], coupled)
        hs[t].copy_(torch.bmm(ms[t], wp_t, out=h_step))
        if t + 1 < steps:
            h_lows[t + 1].copy_(h_step)


def _local_derivatives(acts: torch.Tensor, cells: torch.Tensor, tanh_cells: torch.Tensor,
                       coupled: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For all time steps at once (time-major, gates in the kernel's order o, f[, i], g):
    dc_t += dm_t * to_cell; dz_o = dm_t * to_o; the other gates' pre-activation gradients are
    dc_t * to_gates (f[, i], g)."""
    hidden = cells.shape[-1]
    o, f, g = acts[..., :hidden], acts[..., hidden:2 * hidden], acts[..., -hidden:]
    # in-place chains: every fresh [T, k, B, H] temporary costs its page faults (1 - x^2 computed
    # as -(x^2) + 1, the same float)
    to_cell = torch.mul(tanh_cells, tanh_cells).neg_().add_(1.0).mul_(o)
    to_o = (1.0 - o).mul_(o).mul_(tanh_cells)
    to_gates = cells.new_empty(*cells.shape[:-1], 2 if coupled else 3, hidden)
    c_prev = to_gates[..., 0, :]  # c_{t-1} (0 at t = 0), times the f gate's derivative below
    c_prev[0] = 0.0
    c_prev[1:] = cells[:-1]
    one_f = 1.0 - f
    df = one_f * f  # sigmoid'
    dg = torch.mul(g, g).neg_().add_(1.0)  # tanh'
    if coupled:  # c = f c' + (1 - f) g
        c_prev.sub_(g).mul_(df)
        torch.mul(one_f, dg, out=to_gates[..., 1, :])
    else:  # c = f c' + i g
        i = acts[..., 2 * hidden:3 * hidden]
        c_prev.mul_(df)
        torch.mul((1.0 - i).mul_(i), g, out=to_gates[..., 1, :])
        torch.mul(i, dg, out=to_gates[..., 2, :])
    return to_cell, to_o, to_gates


def _local_derivatives_low(acts: torch.Tensor, cells: torch.Tensor, tanh_cells: torch.Tensor,
                           coupled: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_local_derivatives` in 9 passes over the [T, k, B, H] tensors instead of 17 (the bfloat16
    path's: at the Gboard size the tensors are several MB each and every pass goes to memory).
    The same derivatives with other roundings: o (1 - tc^2) as o - (o tc) tc, o (1 - o) tc as
    o tc - o (o tc), and so on; float32 keeps its own order, whose bits the parity grid pins."""
    hidden = cells.shape[-1]
    o, f, g = acts[..., :hidden], acts[..., hidden:2 * hidden], acts[..., -hidden:]
    o_tc = o * tanh_cells
    to_cell = torch.addcmul(o, o_tc, tanh_cells, value=-1.0)
    to_o = o_tc.addcmul_(o, o_tc, value=-1.0)
    to_gates = cells.new_empty(*cells.shape[:-1], 2 if coupled else 3, hidden)
    c_prev = to_gates[..., 0, :]  # c_{t-1} (- g_t if coupled), times sigmoid'(f) = f (1 - f)
    one_f = 1.0 - f
    if coupled:  # c = f c' + (1 - f) g: dc/df = c' - g, dc/dg = 1 - f
        torch.sub(cells[:-1], g[1:], out=c_prev[1:])
        torch.neg(g[0], out=c_prev[0])
        one_f_g = one_f * g
        torch.addcmul(one_f, one_f_g, g, value=-1.0, out=to_gates[..., 1, :])
    else:  # c = f c' + i g
        i = acts[..., 2 * hidden:3 * hidden]
        c_prev[0] = 0.0
        c_prev[1:] = cells[:-1]
        i_g = i * g
        torch.addcmul(i, i_g, g, value=-1.0, out=to_gates[..., 2, :])
        torch.addcmul(i_g, i, i_g, value=-1.0, out=to_gates[..., 1, :])
    c_prev.mul_(f).mul_(one_f)
    return to_cell, to_o, to_gates


def _layer_backward(d_out: torch.Tensor, saved: tuple, wp: torch.Tensor, coupled: bool,
                    sink: _Sink, name: str, fused: Cell | None = None) -> torch.Tensor:
    """d_out [T, k, B, P] (float32, overwritten) -> d_x [k, T, B, D] (float32); weight gradients
    go to `sink`. At bfloat16 (the saved inputs' dtype) the elementwise recurrence runs in float32
    and writes each step's dz_t in bfloat16 (each product rounded once), the operand of its
    recurrent GEMM and of the two GEMMs over all time steps after the loop: no float32 dz (31 MB at
    the Gboard size) and no cast of it. `fused`: each step's elementwise work, the local
    derivatives included, is one call of the C cell (no [T, k, B, H] derivative tensors)."""
    inputs, acts, cells, tanh_cells, gated, w_x, wh_back, wp_low = saved
    low = inputs.dtype
    k, steps, rows, width = inputs.shape
    hidden, proj, n_gates = wp.shape[2], wp.shape[1], acts.shape[-1]
    d = width - proj - 1
    product = acts.new_empty(k, rows, proj, dtype=low) if low != torch.float32 else None
    dh = d_out  # dh[t] becomes d loss / d h_t once step t+1's recurrent term is added
    dc = cells.new_zeros(k, rows, hidden)
    dc_b = dc.unsqueeze(2)
    # client-major, written per step by the elementwise ops: the weight GEMMs' layout, no copy
    dz_all = acts.new_empty(k, steps, rows, n_gates, dtype=low)
    dzs, dz_o = dz_all.unbind(1), dz_all[..., :hidden].unbind(1)
    dz_rest = dz_all[..., hidden:].unflatten(-1, (-1, hidden)).unbind(1)
    dhs, fs = dh.unbind(0), acts[..., hidden:2 * hidden].unbind(0)
    if fused is None:
        local = _local_derivatives if low == torch.float32 else _local_derivatives_low
        tcell, to_os, tgs = (t.unbind(0) for t in local(acts, cells, tanh_cells, coupled))
    else:  # dm_t = dh_t W_p in bfloat16 (the forward's cast of W_p; dh_t cast, dm_t rounded once)
        zeros = cells.new_zeros(k, rows, hidden)  # c_{-1}
        dh_low, dm_low = (dh.new_empty(k, rows, n, dtype=low) for n in (proj, hidden))
    for t in reversed(range(steps)):
        if fused is not None:
            dm = torch.bmm(dh_low.copy_(dhs[t]), wp_low, out=dm_low)
            fused.backward(dm, acts[t], tanh_cells[t], cells[t - 1] if t else zeros, dc, dzs[t], coupled)
        else:
            dm = torch.bmm(dhs[t], wp)
            dc.addcmul_(dm, tcell[t])
            torch.mul(dm, to_os[t], out=dz_o[t])
            torch.mul(dc_b, tgs[t], out=dz_rest[t])
            if t:
                dc.mul_(fs[t])
        if t:
            if product is None:
                dhs[t - 1].baddbmm_(dzs[t], wh_back)
            else:
                dhs[t - 1].add_(torch.bmm(dzs[t], wh_back, out=product))
    dz = dz_all.view(k, steps * rows, n_gates)
    # before w is updated; float32 (under bfloat16 autocast or on the bfloat16 path the product is
    # bfloat16, and the gradient carried down the layers and into the embedding stays float32)
    d_x = torch.bmm(dz, w_x)[..., :d].float().view(k, steps, rows, d)
    # the weight and bias gradients of all time steps in one GEMM on the inputs [h_{t-1}, x_t, 1]
    grad = torch.bmm(dz.transpose(1, 2), inputs.view(k, steps * rows, width))
    every = slice(None)
    parts = []
    for model, kernel in ((slice(-hidden, None), slice(0, hidden)), (slice(0, -hidden), slice(hidden, None))):
        parts += [(f"{name}.gates.weight", (every, model, slice(0, d)), grad[:, kernel, proj:-1]),
                  (f"{name}.gates.weight", (every, model, slice(d, None)), grad[:, kernel, :proj]),
                  (f"{name}.gates.bias", (every, model), grad[:, kernel, -1])]
    sink.add(parts)
    sink.gemm(f"{name}.proj.weight", _client_major(dh, low).transpose(1, 2),
              gated.view(k, steps * rows, hidden))
    return d_x


def _client_major(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[T, k, B, X] -> contiguous [k, T * B, X] in `dtype` (the layout of the GEMMs over all time
    steps)."""
    steps, k, rows, width = t.shape
    return _dense(t.transpose(0, 1), dtype).view(k, steps * rows, width)


def _groups(counts: list[int], max_rows: int, slack: float = 1.25) -> list[tuple[int, int, int]]:
    """Consecutive clients batched into one GEMM while padding every client to the group's most
    real targets costs at most `slack` x the real rows and the group has at most `max_rows` rows
    (its logits stay a few MB: cache-sized, and reused by the allocator instead of fresh pages):
    (first, end, rows per client)."""
    out, start = [], 0
    while start < len(counts):
        end, top, total = start + 1, counts[start], counts[start]
        while end < len(counts):
            new_top = max(top, counts[end])
            if (new_top * (end + 1 - start) > slack * (total + counts[end]) + 16
                    or new_top * (end + 1 - start) > max_rows):
                break
            top, total, end = new_top, total + counts[end], end + 1
        out.append((start, end, max(top, 1)))
        start = end
    return out


def _softmax_grad(scores: torch.Tensor, tgt: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """scores [N, V] logits (float32 or bfloat16) -> each row's nll [N] (float32); `grads` [N, V]
    (another buffer of the same dtype) becomes softmax - onehot(target).

    At bfloat16 torch's softmax works in float32 inside each row and rounds each probability
    once; the loss is taken from the rounded p_t (relative error 2^-9: the nll moves by at most
    0.002) and the one-hot is subtracted in bfloat16 (rounded once more, as the gradient is
    anyway). No float32 copy of the logits is made: the float32 softmax of a few rows at a time
    in cache-sized buffers, with a float32 bias add, ran the whole Gboard-size output layer 2x
    slower than this at the same GEMMs (mixed-dtype ops convert through a generic path)."""
    n, _ = scores.shape
    nll = scores.new_empty(n, 1, dtype=torch.float32)
    grad = torch._softmax(scores, -1, False, out=grads)
    p_t = grad.gather(1, tgt)
    out = torch.log(p_t.float(), out=nll).neg_()
    tiny = (p_t < 1e-30).nonzero()[:, 0]  # underflowed or denormal p_t: exact log-sum-exp there
    if len(tiny):  # nll = (top - l_t) + log(sum exp(l - top)), the sum's inverse the softmax at
        # the top logit (exp(0) / sum): no second exp pass (logsumexp's was 12% of a step on
        # rounds where clients diverge and most targets underflow)
        rows_t = scores[tiny].float()
        top, arg = rows_t.max(1, keepdim=True)
        out[tiny] = (top - rows_t.gather(1, tgt[tiny])).sub_(grad[tiny.unsqueeze(1), arg].float().log_())
    # softmax - onehot, unscaled: the weights enter on the GEMMs' other side (written at the targets'
    # flat offsets: a bfloat16 scatter_add_ converted the whole [N, V] tensor twice)
    grad.view(-1)[torch.arange(n, device=tgt.device) * scores.shape[1] + tgt[:, 0]] = p_t[:, 0] - 1.0
    return nll.view(-1)


def _pack(y: torch.Tensor, flat_real: torch.Tensor, targets: torch.Tensor, counts: torch.Tensor,
          groups: list[tuple[int, int, int]], low: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Each client's real positions packed into the rows of its group's block (see `_output_layer`):
    (packed y in `low` (float32: [y, 1], the output bias rides in the GEMMs), targets [N, 1],
    weights [N, 1] (1 / n_j, 0 on fill rows), dst, src)."""
    steps, k, rows, proj = y.shape
    positions = steps * rows
    offset = torch.zeros(k, dtype=torch.int64)
    base = 0
    for first, end, n in groups:
        offset[first:end] = base + n * torch.arange(end - first)
        base += n * (end - first)
    client, pos = flat_real.nonzero(as_tuple=True)  # client-major, positions in order
    slot = flat_real.cumsum(1)[client, pos] - 1
    dst = offset[client] + slot
    t, r = pos // rows, pos % rows
    src = (t * k + client) * rows + r  # row of y's time-major [T * k * B, P] view
    ones = low == torch.float32
    packed = y.new_zeros(base, proj + ones, dtype=low)
    packed[dst, :proj] = y.reshape(-1, proj)[src].to(low)
    if ones:
        packed[:, proj] = 1.0
    tgt = torch.zeros(base, 1, dtype=torch.int64, device=y.device)
    tgt[dst, 0] = targets.reshape(-1)[client * positions + pos]
    inv = 1.0 / counts.clamp_min(1).to(torch.float32)
    weight = y.new_zeros(base, 1, dtype=torch.float32)
    weight[dst, 0] = inv[client]
    return packed, tgt, weight, dst, src


def _group_f32(yg: torch.Tensor, wg: torch.Tensor, tgt: torch.Tensor, w_g: torch.Tensor,
               b_g: torch.Tensor, scores: torch.Tensor, d_packed: torch.Tensor,
               names: tuple[str, str]) -> tuple[torch.Tensor, list]:
    """One group's output layer in float32: yg [m, n, P+1] ([y, 1]), wg [m, n, 1] row weights.
    Returns each row's nll and the weight and bias gradients as sink parts; d_packed [m, n, P]
    gets the gradient of y (unscaled)."""
    m, n, width = yg.shape
    vocab = w_g.shape[1]
    # [W, b] (a copy of P+1 floats per word; baddbmm copied the bias into every logit row)
    w_b = yg.new_empty(m, vocab, width)
    w_b[..., :-1], w_b[..., -1] = w_g, b_g
    logits = torch.bmm(yg, w_b.transpose(1, 2), out=scores[0, : m * n * vocab].view(m, n, vocab))
    grad = scores[1, : m * n * vocab].view(m, n, vocab)
    nll = _softmax_grad(logits.view(-1, vocab), tgt, grad.view(-1, vocab))
    torch.bmm(grad, w_g, out=d_packed)  # before w_out is updated
    # [dW, db]^T in one GEMM ([P+1, V]: the faster shape; the bias row from the ones column)
    g_t = torch.bmm((yg * wg).transpose(1, 2), grad)
    return nll, [(names[0], (), g_t[:, :-1].transpose(1, 2)), (names[1], (), g_t[:, -1])]


def _group_low(yg: torch.Tensor, wg: torch.Tensor, tgt: torch.Tensor, w_g: torch.Tensor,
               b_g: torch.Tensor, scores: torch.Tensor, d_packed: torch.Tensor,
               names: tuple[str, str], fused: Cell | None = None) -> tuple[torch.Tensor, list]:
    """`_group_f32` at bfloat16 (yg [m, n, P] in `low`, no ones column): GEMMs with an inner or
    outer dimension of P, not P + 1 (96 against 97 ran the three GEMMs 1.3x, 2.1x and 1.2x faster
    at the Gboard size: AMX tiles hold 32 bfloat16); the bias is added to the bfloat16 logits
    (rounded once with the product, as in a GEMM with a bias column) and its gradient is the
    column sum of each client's real rows of the softmax's gradient (accumulated in float32 by
    torch's reduction, rounded to bfloat16, scaled by 1 / n_j in float32)."""
    m, n, _ = yg.shape
    vocab = w_g.shape[1]
    # [m, V, P]: contiguous, cast in one pass
    w_lo = fused.to_bf16(w_g) if fused is not None and w_g.is_contiguous() else _dense(w_g, yg.dtype)
    logits = torch.bmm(yg, w_lo.transpose(1, 2), out=scores[0, : m * n * vocab].view(m, n, vocab))
    grad = scores[1, : m * n * vocab].view(m, n, vocab)
    if fused is not None:  # bias, softmax, loss, one-hot and the bias gradient in one C pass per row
        nll, g_b = fused.softmax_xent(logits, b_g, tgt, wg, grad)
    else:
        logits.add_(b_g.to(yg.dtype).unsqueeze(1))  # rounded once with the product, as a bias column was
        nll = _softmax_grad(logits.view(-1, vocab), tgt, grad.view(-1, vocab))
        real = (wg.view(m, n) > 0).sum(1).tolist()  # a client's real rows come first in its block
        g_b = torch.stack([grad[j, : real[j]].sum(0) for j in range(m)]).float().mul_(wg.view(m, n)[:, :1])
    d_packed.copy_(torch.bmm(grad, w_lo))  # before w_out is updated
    g_v = torch.bmm(grad.transpose(1, 2), (yg * wg).to(yg.dtype))  # [V, P]: no transposed add
    return nll, [(names[0], (), g_v), (names[1], (), g_b)]


def _output_layer(y: torch.Tensor, real: torch.Tensor, targets: torch.Tensor, w_out: torch.Tensor,
                  b_out: torch.Tensor, sink: _Sink, w_name: str, b_name: str,
                  low: torch.dtype = torch.float32,
                  fused: Cell | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits, mean cross-entropy and its gradient at real target positions only.

    y [T, k, B, P]; real/targets [k, T, B]. Client j's real positions fill rows 0..n_j-1 of its
    block in a packed [rows, P] matrix (`_pack`); consecutive clients with similar n_j share one
    batched GEMM (`_groups`), each padded to the group's largest n_j; a fill row has weight 0 in
    every gradient. Returns (loss [k], d_y [T, k, B, P]).

    `low` bfloat16 (the bfloat16 path, `_group_low`): the three GEMMs take bfloat16 operands (the
    weights cast once per call); the logits GEMM writes bfloat16 and `_softmax_grad` turns them
    into the loss and the softmax's gradient, bfloat16, the two backward GEMMs' operand; loss and
    d_y are float32.
    """
    steps, k, rows, proj = y.shape
    f32 = torch.float32
    flat_real = real.reshape(k, steps * rows)
    counts = flat_real.sum(1)
    d_y = torch.zeros_like(y)
    loss = y.new_zeros(k)
    groups = [g for g in _groups(counts.tolist(), LOGITS_FLOATS // w_out.shape[1])
              if counts[g[0] : g[1]].any()]
    if not groups:  # no real target anywhere: loss 0 and a zero gradient, as next_token_loss gives
        return loss, d_y
    packed, tgt, weight, dst, src = _pack(y, flat_real, targets, counts, groups, low)
    d_packed = y.new_empty(len(packed), proj, dtype=f32)
    vocab = w_out.shape[1]
    # one logits buffer for all groups: each fresh multi-MB tensor costs its page faults (the
    # logits GEMM ran 4x slower into fresh pages than into reused ones)
    # (and a second one for the softmax's gradient)
    most = max((end - first) * n for first, end, n in groups) * vocab
    scores = y.new_empty(2, most, dtype=low)
    group = _group_f32 if low == f32 else functools.partial(_group_low, fused=fused)
    base = 0
    for first, end, n in groups:
        m = end - first
        block = slice(base, base + m * n)
        base += m * n
        wg = weight[block].view(m, n, 1)
        nll, parts = group(packed[block].view(m, n, -1), wg, tgt[block], w_out[first:end],
                           b_out[first:end], scores, d_packed[block].view(m, n, proj),
                           (w_name, b_name))
        loss[first:end] = (nll.view(m, n) * (wg.view(m, n) > 0)).sum(1) / counts[first:end].clamp_min(1)
        sink.add(parts, slice(first, end))
    d_y.view(-1, proj)[src] = d_packed[dst].mul_(weight[dst])
    return loss, d_y


def recurrent_grads(cfg: ModelConfig, params: dict[str, torch.Tensor], rows: torch.Tensor,
                    lr: float | None = None, dtype: torch.dtype = torch.float32
                    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Per-client gradients and mean losses of a recurrent zoo model on one minibatch each.

    params: the model's parameters stacked over k clients ([k, *shape]); rows [k, B, L+1] token
    rows (PAD-filled). Equal to `vmap(grad_and_value(next_token_loss o model))` up to rounding.
    With `lr`: one SGD step is applied to `params` in place instead and the gradients returned
    are empty ({}): each weight is updated only after its last use in the step.
    `dtype` bfloat16: the GEMMs in bfloat16 from bfloat16 copies of the float32 weights made once
    per call (the module docstring's "bfloat16"); the weights, their updates, the gradients and
    the loss stay float32.
    """
    k, _, _ = rows.shape
    targets_all = rows[:, :, 1:]
    real_cols = (targets_all != PAD).any(0).any(0).nonzero()
    steps = int(real_cols[-1]) + 1 if len(real_cols) else 1  # cut trailing all-PAD columns
    inputs = rows[:, :, :steps].transpose(1, 2)  # [k, T, B]
    targets = targets_all[:, :, :steps].transpose(1, 2)
    real = targets != PAD
    embed = params["embed.weight"]
    vocab, dim = embed.shape[1], embed.shape[2]
    flat_ids = (inputs + torch.arange(k, device=rows.device).view(k, 1, 1) * vocab).reshape(-1)
    x = embed.reshape(k * vocab, dim)[flat_ids].view(*inputs.shape, dim)
    coupled = cfg.arch == "cifg"
    # the C kernels are the CPU's (a CUDA cohort runs the torch ops)
    fused = cell() if dtype != torch.float32 and embed.device.type == "cpu" else None
    fused = fused if fused is not None and fused.lib is not None else None
    names = [f"layers.{i}" for i in range(cfg.num_layers)]
    saved = []
    for depth, name in enumerate(names):
        if depth:  # the next layer's input, client-major
            x = x.transpose(0, 1).contiguous()
        x, keep = _layer_forward(x, params[f"{name}.gates.weight"], params[f"{name}.gates.bias"],
                                 params[f"{name}.proj.weight"], coupled, dtype, fused)
        saved.append(keep)
    sink = _Sink(params, lr, fused)
    out_names = ("embed.weight", "output_bias") if cfg.tie_embeddings else ("output.weight", "output.bias")
    loss, d_x = _output_layer(x, real, targets, params[out_names[0]], params[out_names[1]], sink,
                              *out_names, dtype, fused)
    for depth, name, keep in zip(reversed(range(len(names))), reversed(names), reversed(saved),
                                 strict=True):
        d_x = _layer_backward(d_x, keep, params[f"{name}.proj.weight"], coupled, sink, name, fused)
        if depth:  # the layer below takes its output gradient time-major
            d_x = d_x.transpose(0, 1).contiguous()
    # a frequent token's gradient is summed first and applied once (added to the weight one
    # occurrence at a time, each addition rounds at the weight's scale: 2e-6 off after 7 steps)
    used, where = torch.unique(flat_ids, return_inverse=True)
    d_rows = d_x.new_zeros(len(used), dim).index_add_(0, where, d_x.reshape(-1, dim))
    target, alpha = sink.target("embed.weight")
    target.view(k * vocab, dim).index_add_(0, used, d_rows, alpha=alpha)
    return sink.grads, loss
