"""Hand-written forward and backward of the zoo's recurrent LMs (LSTM, CIFG) for a cohort.

Why not autograd (`vmap(grad(...))`, the transformer's path in `cohort.py`): on the peer workload
a sequential step spends most of its time in ~100 small matmuls per step, because autograd
differentiates the unrolled time loop step by step; every step's weight gradient is a GEMM with
an inner dimension of only `batch` (16) rows. Here the same arithmetic is regrouped, exactly up
to float rounding:

* the input projection x_t @ W_x of all time steps is one GEMM before the recurrence (only
  h_{t-1} @ W_h stays inside it), and the weight gradients of the gates and the projection are one
  GEMM each over all time steps after the backward recurrence;
* every matmul is batched over the client axis (`bmm`, client j uses only its own weights);
* trailing columns with no real target are cut off (a causal model's later positions cannot
  change earlier outputs), and the output layer, log-softmax and loss run only at real (non-PAD)
  target positions, client by client, so padding costs no vocabulary-sized work.

Gradients are those of each client's own mean next-token loss (`next_token_loss`): clients never
share a tensor row, so client j's gradient depends on client j's rows only (tested as an attack
in tests/test_edge_cohort.py).
"""

from __future__ import annotations

import torch

from dpfleet.edge.tokenizer import PAD
from dpfleet.export.models import ModelConfig

RECURRENT = ("lstm", "cifg")


def fused_bytes_per_client(cfg: ModelConfig, batch_size: int, seq_len: int, n_params: int) -> int:
    """Working memory of one client in a fused chunk (float32).

    Weights + gradient + update temporary (3 x params), and per token and layer the saved
    activations of the recurrence: input, gate pre-activations, activated gates and their
    gradient (3 x gates), cell, tanh(cell), gated output (3 x hidden), output and its gradient.
    The vocabulary-sized logits live one client at a time, so they do not scale with the chunk.
    """
    gates = (3 if cfg.arch == "cifg" else 4) * cfg.hidden_dim
    per_token = cfg.num_layers * (cfg.embedding_dim + 3 * gates + 3 * cfg.hidden_dim
                                  + 2 * cfg.projection_dim)
    return 4 * (3 * n_params + batch_size * seq_len * per_token)


def _layer_forward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, wp: torch.Tensor,
                   coupled: bool) -> tuple[torch.Tensor, tuple]:
    """x [k, T, B, D] (time-major per client) -> outputs [k, T, B, P] and what backward needs."""
    k, steps, rows, d = x.shape
    n_gates, hidden, proj = w.shape[1], wp.shape[2], wp.shape[1]
    wx, wh_t, wp_t = w[:, :, :d], w[:, :, d:].transpose(1, 2), wp.transpose(1, 2)
    # the input projection of every time step in one GEMM
    zx = torch.baddbmm(b.unsqueeze(1), x.reshape(k, steps * rows, d), wx.transpose(1, 2))
    zx = zx.view(k, steps, rows, n_gates)
    h = x.new_zeros(k, rows, proj)
    c = x.new_zeros(k, rows, hidden)
    acts, cells, tanh_cells, gated, outs = [], [], [], [], []
    for t in range(steps):
        z = torch.baddbmm(zx[:, t], h, wh_t)  # activated in place: z becomes the saved gates
        if coupled:
            f, g, o = z.split(hidden, dim=-1)
            f.sigmoid_()
            g.tanh_()
            o.sigmoid_()
            c = f * c + (1.0 - f) * g
        else:
            f, i, g, o = z.split(hidden, dim=-1)
            f.sigmoid_()
            i.sigmoid_()
            g.tanh_()
            o.sigmoid_()
            c = f * c + i * g
        acts.append(z)
        tc = torch.tanh(c)
        m = o * tc
        h = torch.bmm(m, wp_t)
        cells.append(c)
        tanh_cells.append(tc)
        gated.append(m)
        outs.append(h)
    out = torch.stack(outs, dim=1)
    return out, (x, out, torch.stack(acts, 1), torch.stack(cells, 1), torch.stack(tanh_cells, 1),
                 torch.stack(gated, 1))


def _layer_backward(d_out: torch.Tensor, saved: tuple, w: torch.Tensor, wp: torch.Tensor,
                    coupled: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """d_out [k, T, B, P] -> (d_x, d_gates_weight, d_gates_bias, d_proj_weight)."""
    x, out, acts, cells, tanh_cells, gated = saved
    k, steps, rows, d = x.shape
    hidden = wp.shape[2]
    wx, wh = w[:, :, :d], w[:, :, d:]
    dh = torch.zeros_like(d_out[:, 0])
    dc = torch.zeros_like(cells[:, 0])
    dz_all = torch.empty_like(acts)  # [k, T, B, gates], written slice by slice (no concatenation)
    dh_all = torch.empty_like(d_out)
    for t in reversed(range(steps)):
        dht = torch.add(d_out[:, t], dh, out=dh_all[:, t])
        dm = torch.bmm(dht, wp)
        tc = tanh_cells[:, t]
        a = acts[:, t]
        c_prev = cells[:, t - 1] if t else torch.zeros_like(dc)
        dz = dz_all[:, t]
        if coupled:
            f, g, o = a.split(hidden, dim=-1)
            dz_f, dz_g, dz_o = dz.split(hidden, dim=-1)
        else:
            f, i, g, o = a.split(hidden, dim=-1)
            dz_f, dz_i, dz_g, dz_o = dz.split(hidden, dim=-1)
        dc = dc + dm * o * (1.0 - tc * tc)
        torch.mul(dm * tc, o * (1.0 - o), out=dz_o)
        dg = dc * (1.0 - g * g)
        if coupled:  # c = f c' + (1 - f) g
            torch.mul(dc * (c_prev - g), f * (1.0 - f), out=dz_f)
            torch.mul(dg, 1.0 - f, out=dz_g)
        else:  # c = f c' + i g
            torch.mul(dc * c_prev, f * (1.0 - f), out=dz_f)
            torch.mul(dc * g, i * (1.0 - i), out=dz_i)
            torch.mul(dg, i, out=dz_g)
        dc = dc * f
        dh = torch.bmm(dz, wh)
    dz = dz_all.view(k, steps * rows, -1)
    dh_tot = dh_all.reshape(k, steps * rows, -1)
    h_prev = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], dim=1)
    inputs = torch.cat([x, h_prev], dim=-1).reshape(k, steps * rows, -1)
    # the weight gradients of all time steps, one GEMM each
    d_w = torch.bmm(dz.transpose(1, 2), inputs)
    d_b = dz.sum(1)
    d_wp = torch.bmm(dh_tot.transpose(1, 2), gated.reshape(k, steps * rows, hidden))
    d_x = torch.bmm(dz, wx).view(k, steps, rows, d)
    return d_x, d_w, d_b, d_wp


def _output_layer(y: torch.Tensor, real: torch.Tensor, targets: torch.Tensor, w_out: torch.Tensor,
                  b_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits, mean cross-entropy and its gradient at real target positions only, per client.

    y [k, T, B, P]; real/targets [k, T, B]. Returns (loss [k], d_y, d_w_out, d_b_out).
    """
    k = y.shape[0]
    loss = y.new_zeros(k)
    d_y = torch.zeros_like(y)
    d_w = torch.zeros_like(w_out)
    d_b = torch.zeros_like(b_out)
    for j in range(k):
        mask = real[j]
        yj = y[j][mask]
        n = yj.shape[0]
        if n == 0:  # no real target: loss 0 and a zero gradient, as next_token_loss gives
            continue
        tj = targets[j][mask]
        logp = torch.log_softmax(torch.addmm(b_out[j], yj, w_out[j].t()), dim=-1)
        picked = logp.gather(1, tj.unsqueeze(1)).squeeze(1)
        loss[j] = -picked.sum() / n
        grad = logp.exp_()  # softmax - onehot, over n
        grad[torch.arange(n), tj] -= 1.0
        grad.div_(n)
        torch.mm(grad.t(), yj, out=d_w[j])
        d_b[j] = grad.sum(0)
        d_y[j][mask] = grad @ w_out[j]
    return loss, d_y, d_w, d_b


def recurrent_grads(cfg: ModelConfig, params: dict[str, torch.Tensor], rows: torch.Tensor
                    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Per-client gradients and mean losses of a recurrent zoo model on one minibatch each.

    params: the model's parameters stacked over k clients ([k, *shape]); rows [k, B, L+1] token
    rows (PAD-filled). Equal to `vmap(grad_and_value(next_token_loss o model))` up to rounding.
    """
    k, _, _ = rows.shape
    targets_all = rows[:, :, 1:]
    real_cols = (targets_all != PAD).any(0).any(0).nonzero()
    steps = int(real_cols[-1]) + 1 if len(real_cols) else 1  # cut trailing all-PAD columns
    inputs = rows[:, :, :steps].transpose(1, 2)  # time-major [k, T, B]
    targets = targets_all[:, :, :steps].transpose(1, 2)
    real = targets != PAD
    embed = params["embed.weight"]
    vocab, dim = embed.shape[1], embed.shape[2]
    flat_ids = (inputs + torch.arange(k, device=rows.device).view(k, 1, 1) * vocab).reshape(-1)
    x = embed.reshape(k * vocab, dim)[flat_ids].view(*inputs.shape, dim)
    coupled = cfg.arch == "cifg"
    names = [f"layers.{i}" for i in range(cfg.num_layers)]
    saved = []
    for name in names:
        x, keep = _layer_forward(x, params[f"{name}.gates.weight"], params[f"{name}.gates.bias"],
                                 params[f"{name}.proj.weight"], coupled)
        saved.append(keep)
    if cfg.tie_embeddings:
        w_out, b_out = embed, params["output_bias"]
    else:
        w_out, b_out = params["output.weight"], params["output.bias"]
    loss, d_x, d_w_out, d_b_out = _output_layer(x, real, targets, w_out, b_out)
    grads: dict[str, torch.Tensor] = {}
    for name, keep in zip(reversed(names), reversed(saved), strict=True):
        d_x, d_w, d_b, d_wp = _layer_backward(d_x, keep, params[f"{name}.gates.weight"],
                                              params[f"{name}.proj.weight"], coupled)
        grads[f"{name}.gates.weight"], grads[f"{name}.gates.bias"] = d_w, d_b
        grads[f"{name}.proj.weight"] = d_wp
    d_embed = torch.zeros_like(embed).view(k * vocab, dim)
    d_embed.index_add_(0, flat_ids, d_x.reshape(-1, dim))
    d_embed = d_embed.view(k, vocab, dim)
    if cfg.tie_embeddings:
        d_embed += d_w_out
        grads["output_bias"] = d_b_out
    else:
        grads["output.weight"], grads["output.bias"] = d_w_out, d_b_out
    grads["embed.weight"] = d_embed
    return grads, loss
