"""On-device training through plain ONNX Runtime: the program returns loss and gradients.

`onnxruntime-training` is discontinued (no Python 3.12 wheels, clashes with `onnxruntime`), so
the exported program takes the weights as inputs and returns the loss and one gradient per
weight; the host keeps the weights and applies SGD. The batch dimension is dynamic; the sequence
length is fixed (the recurrent loop is unrolled), so rows are PAD-extended.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dpfleet.edge.minibatch import check_examples, fixed_shape_batches
from dpfleet.edge.ort_session import load_session
from dpfleet.edge.runtime import EpochResult, HostWeights
from dpfleet.errors import DpfleetError
from dpfleet.export.models import ModelConfig
from dpfleet.export.params import ParamLayout
from dpfleet.export.training import (
    ProgramFile,
    ProgramSpec,
    onnx_grad_name,
    onnx_param_name,
    training_program,
)


class OnnxTrainingProgram:
    """A validated ONNX training program: (inputs, targets, *weights) -> (loss, *grads)."""

    def __init__(self, program: ProgramFile, layout: ParamLayout, threads: int | None):
        if program.spec.fmt != "onnx":
            raise DpfleetError(f"{program.path} is a {program.spec.fmt} program, not onnx")
        if program.layout != layout:
            raise DpfleetError(f"{program.path} was exported for another model: its weights differ")
        self.path = program.path
        self.seq_len = program.spec.seq_len
        self.layout = layout
        self._session = load_session(program.read_verified(), program.path, threads)
        self._check_signature()

    def _check_signature(self) -> None:
        ins = {i.name: i.shape for i in self._session.get_inputs()}
        outs = [o.name for o in self._session.get_outputs()]
        want = {"inputs": self.seq_len, "targets": self.seq_len}
        for name, length in want.items():
            if name not in ins or len(ins[name]) != 2 or ins[name][1] != length:
                raise DpfleetError(f"{self.path} does not take [batch, {length}] {name}")
        for name, shape in zip(self.layout.names, self.layout.shapes, strict=True):
            if tuple(ins.get(onnx_param_name(name), ())) != shape:
                raise DpfleetError(f"{self.path}: weight input {name!r} missing or misshapen")
        if outs != ["loss", *map(onnx_grad_name, self.layout.names)]:
            raise DpfleetError(f"{self.path}: outputs are not the loss and the gradients")

    def step(
        self, weights: dict[str, np.ndarray], inputs: np.ndarray, targets: np.ndarray, lr: float
    ) -> float:
        """One loss-and-gradient run, then SGD in place on the host's weight views."""
        feed = {"inputs": inputs, "targets": targets}
        feed.update({onnx_param_name(n): w for n, w in weights.items()})
        loss, *grads = self._session.run(None, feed)
        step = np.float32(lr)
        for name, g in zip(self.layout.names, grads, strict=True):
            weights[name] -= step * g
        return float(loss)


class OnnxRuntime(HostWeights):
    """TrainingRuntime over plain onnxruntime; one cached dynamic-batch program."""

    name = "onnx"

    def __init__(self, cfg: ModelConfig, seq_len: int, threads: int | None, cache_dir: Path):
        self.cfg = cfg
        self.seq_len = seq_len
        super().__init__(cfg)
        spec = ProgramSpec(cfg, seq_len, None, "onnx")
        self.program = OnnxTrainingProgram(training_program(spec, Path(cache_dir)), self.layout, threads)

    def train_epoch(self, examples: np.ndarray, lr: float, batch_size: int, seed: int) -> EpochResult:
        rows = check_examples(examples, self.cfg.vocab_size, self.seq_len)
        views = self.layout.split(self._flat)  # updated in place
        losses = [
            self.program.step(views, x, y, lr)
            for x, y in fixed_shape_batches(rows, batch_size, seed, self.seq_len, pad_rows=False)
        ]
        return EpochResult(float(np.mean(losses)) if losses else float("nan"), len(losses))
