"""On-device training through an ExecuTorch joint forward-backward program (`.pte`).

Facts this relies on (ExecuTorch 1.5.1; tests/test_edge_runtime_{parity,bad_input}.py check
them): the runtime does not copy the buffer a program is loaded from (we keep it referenced: dropping it
segfaults); with `clone_outputs=False` the parameter outputs alias the runtime's own weight
memory, available after the first run, so a round's weights are set with `copy_` and SGD is applied
in place; the batch is static, so the last partial minibatch is PAD-padded (exact, see
`fixed_shape_batches`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dpfleet.edge.minibatch import check_examples, fixed_shape_batches
from dpfleet.edge.pte_module import PteModule, set_threads
from dpfleet.edge.runtime import EpochResult, HostWeights
from dpfleet.errors import DpfleetError
from dpfleet.export.models import ModelConfig
from dpfleet.export.params import ParamLayout
from dpfleet.export.training import ProgramFile, ProgramSpec, training_program

METHOD = "forward"
_PREFIX = "model."  # LossModule holds the zoo model as `model`


class PteTrainingProgram:
    """One loaded training program, validated before any of its bytes reach native code."""

    def __init__(self, program: ProgramFile, layout: ParamLayout):
        if program.spec.fmt != "pte":
            raise DpfleetError(f"{program.path} is a {program.spec.fmt} program, not pte")
        if program.layout != layout:
            raise DpfleetError(f"{program.path} was exported for another model: its weights differ")
        self._pte = PteModule(program.read_verified(), program.path)
        self.path = program.path
        self.batch = program.spec.batch
        self.seq_len = program.spec.seq_len
        self.layout = layout
        self._check_signature()
        self._params: list[torch.Tensor] | None = None

    def _meta(self, prefix: str) -> list:
        return self._pte.run(f"__et_training_{prefix}_{METHOD}", ())

    def _check_signature(self) -> None:
        names = self._pte.methods
        needed = {
            METHOD,
            *(f"__et_training_{p}_{METHOD}" for p in ("gradients_index", "parameters_index", "fqn")),
        }
        if not needed <= names:
            raise DpfleetError(f"{self.path} is not a training program (methods: {sorted(names)})")
        meta = self._pte.metas[METHOD]
        want = (self.batch, self.seq_len)
        if meta.num_inputs() != 2 or any(tuple(meta.input_tensor_meta(i).sizes()) != want for i in range(2)):
            raise DpfleetError(f"{self.path} does not take two [{want[0]}, {want[1]}] token inputs")
        self._grad0 = int(self._meta("gradients_index")[0])
        self._param0 = int(self._meta("parameters_index")[0])
        fqns = [str(f) for f in self._meta("fqn")]
        n = len(self.layout.names)
        if fqns != [_PREFIX + name for name in self.layout.names] or (
            self._grad0,
            self._param0,
            meta.num_outputs(),
        ) != (1, 1 + n, 1 + 2 * n):
            raise DpfleetError(f"{self.path}: parameters do not match the model's layout")
        for i, shape in enumerate(self.layout.shapes):
            for out in (self._grad0 + i, self._param0 + i):
                if tuple(meta.output_tensor_meta(out).sizes()) != shape:
                    raise DpfleetError(f"{self.path}: output {out} has the wrong shape")

    def _run(self, inputs: np.ndarray, targets: np.ndarray) -> list[torch.Tensor]:
        args = (torch.from_numpy(inputs), torch.from_numpy(targets))
        outs = self._pte.run(METHOD, args)
        if self._params is None:
            self._params = list(outs[self._param0 :])
        return outs

    def params(self) -> list[torch.Tensor]:
        """The runtime's own weight tensors (aliases), after one all-PAD run if needed."""
        if self._params is None:  # an all-PAD batch: loss 0, and no update is applied
            pad = np.zeros((self.batch, self.seq_len), dtype=np.int64)
            self._run(pad, pad)
        return self._params

    def set_flat(self, flat: np.ndarray) -> None:
        parts = self.layout.split(flat)
        with torch.no_grad():
            for p, name in zip(self.params(), self.layout.names, strict=True):
                p.copy_(torch.from_numpy(parts[name]))

    def get_flat(self) -> np.ndarray:
        return torch.cat([p.reshape(-1) for p in self.params()]).numpy().copy()

    def step(self, inputs: np.ndarray, targets: np.ndarray, lr: float) -> float:
        """One forward-backward in the runtime, then SGD in place on its weights."""
        outs = self._run(inputs, targets)
        with torch.no_grad():
            for p, g in zip(self._params, outs[self._grad0 : self._param0], strict=True):
                p.add_(g, alpha=-lr)
        return float(outs[0])


class ExecuTorchRuntime(HostWeights):
    """TrainingRuntime over ExecuTorch; one cached program per batch size (static batch)."""

    name = "executorch"

    def __init__(self, cfg: ModelConfig, seq_len: int, threads: int | None, cache_dir: Path):
        self.cfg = cfg
        self.seq_len = seq_len
        self.cache_dir = Path(cache_dir)
        super().__init__(cfg)
        self._programs: dict[int, PteTrainingProgram] = {}
        set_threads(threads)

    def program(self, batch_size: int) -> PteTrainingProgram:
        """The loaded program for `batch_size`, exported on first use (slow) and cached."""
        if batch_size not in self._programs:
            spec = ProgramSpec(self.cfg, self.seq_len, batch_size, "pte")
            self._programs[batch_size] = PteTrainingProgram(
                training_program(spec, self.cache_dir), self.layout
            )
        return self._programs[batch_size]

    def train_epoch(self, examples: np.ndarray, lr: float, batch_size: int, seed: int) -> EpochResult:
        rows = check_examples(examples, self.cfg.vocab_size, self.seq_len)
        program = self.program(batch_size)
        program.set_flat(self._flat)
        losses = [
            program.step(x, y, lr)
            for x, y in fixed_shape_batches(rows, batch_size, seed, self.seq_len, pad_rows=True)
        ]
        self._flat = program.get_flat()
        return EpochResult(float(np.mean(losses)) if losses else float("nan"), len(losses))
