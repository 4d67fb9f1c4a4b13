"""Streaming keyboard inference for the recurrent models: `step(token, state) -> (logits, state)`.

The window program recomputes a fixed seq_len window and returns seq_len x V logits for every
keystroke; the step program feeds one token into the carried (h, c) state and returns only the
next-token logits, so a keyboard pays one small step per new token. It is the same cell math as
training (`RecurrentCell.step`), so while a message has at most seq_len - 1 tokens the step logits
equal the window program's logits at the last position (tested).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from dpfleet.errors import DpfleetError
from dpfleet.export.console_capture import exporter_step
from dpfleet.export.models import ModelConfig, RecurrentLM, output_logits
from dpfleet.export.weight_inputs import export_with_weight_inputs

STEP_INPUTS = ("token", "state_h", "state_c")
STEP_OUTPUTS = ("logits", "next_h", "next_c")


class StreamingStep(nn.Module):
    """token [b] int64, state_h [layers, b, projection], state_c [layers, b, hidden] ->
    logits [b, V], next_h, next_c."""

    def __init__(self, model: RecurrentLM):
        super().__init__()
        if not isinstance(model, RecurrentLM):
            raise DpfleetError("streaming steps exist for the recurrent models (cifg, lstm) only")
        self.model = model

    def forward(self, token: torch.Tensor, state_h: torch.Tensor, state_c: torch.Tensor):
        x = self.model.embed(token)
        hs, cs = [], []
        for i, layer in enumerate(self.model.layers):
            x, c = layer.step(x, state_h[i], state_c[i])
            hs.append(x)
            cs.append(c)
        return output_logits(self.model, x), torch.stack(hs), torch.stack(cs)


def initial_state(cfg: ModelConfig, batch: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """The zero state a message starts from (then feed bos_id)."""
    return (np.zeros((cfg.num_layers, batch, cfg.projection_dim), np.float32),
            np.zeros((cfg.num_layers, batch, cfg.hidden_dim), np.float32))


def step_program(model: RecurrentLM, path: Path, weight_inputs: bool = True) -> None:
    """Export the step to ONNX with a dynamic batch (a keyboard scores k candidates at once); the
    weights are `p.<name>` inputs (`export/weight_inputs.py`) unless `weight_inputs=False`."""
    cfg = model.cfg
    h, c = (torch.from_numpy(s) for s in initial_state(cfg, 2))
    args = (torch.tensor([1, 1]), h, c)
    batch = torch.export.Dim("batch", min=1, max=4096)
    shapes = ({0: batch}, {1: batch}, {1: batch})
    step = StreamingStep(model).eval()
    if weight_inputs:
        export_with_weight_inputs(step, model, args, list(STEP_INPUTS), list(STEP_OUTPUTS), shapes, path,
                                  prefix="model.")
        return
    with exporter_step("ONNX export"):
        program = torch.onnx.export(step, args, dynamo=True, input_names=list(STEP_INPUTS),
                                    output_names=list(STEP_OUTPUTS), dynamic_shapes=shapes, optimize=True,
                                    verbose=False)
    program.save(str(path))


def streamed_logits(
    session, cfg: ModelConfig, rows: np.ndarray, lengths: np.ndarray, weights: dict | None = None
) -> np.ndarray:
    """Next-token logits [n, V] after feeding rows[i, :lengths[i]] token by token, all rows as one
    batch per step (shorter rows keep the logits of their last real token); `weights`: the
    `p.<name>` feed of a weight-input program."""
    h, c = initial_state(cfg, len(rows))
    out = np.zeros((len(rows), cfg.vocab_size), np.float32)
    for t in range(int(lengths.max())):
        feed = {"token": rows[:, t].astype(np.int64), "state_h": h, "state_c": c, **(weights or {})}
        logits, h, c = session.run(None, feed)
        done = lengths == t + 1
        out[done] = logits[done]
    return out


def step_latency_ms(session, cfg: ModelConfig, weights: dict | None = None, repeats: int = 200,
                    feed: dict | None = None) -> dict:
    """One keystroke's step: one token in, next-token logits and state out (batch 1); `feed`: the
    step's own inputs when they are not the recurrent state (the transformer's KV step)."""
    import time

    if feed is None:
        h, c = initial_state(cfg, 1)
        feed = {"token": np.array([1], np.int64), "state_h": h, "state_c": c}
    feed = {**feed, **(weights or {})}
    for _ in range(5):
        session.run(None, feed)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        session.run(None, feed)
        times.append((time.perf_counter() - t) * 1e3)
    return {"median": float(np.median(times)), "p90": float(np.percentile(times, 90))}
