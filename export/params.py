"""The canonical flat layout of a model's trainable weights.

Server and devices exchange weights and deltas as one float32 vector in `named_parameters()`
order. Every runtime (eager, ExecuTorch, ONNX Runtime) reads and writes through this layout, so
the coordinator never knows which one ran.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from dpfleet.errors import DpfleetError


@dataclass(frozen=True)
class ParamLayout:
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, model: nn.Module) -> ParamLayout:
        items = list(model.named_parameters())
        return cls(tuple(n for n, _ in items), tuple(tuple(p.shape) for _, p in items))

    @property
    def sizes(self) -> list[int]:
        return [int(np.prod(s)) for s in self.shapes]

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def split(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """Flat vector -> name -> array (views, no copy)."""
        if flat.shape != (self.total,):
            raise DpfleetError(f"weight vector has shape {flat.shape}, expected ({self.total},)")
        out, start = {}, 0
        for name, shape, size in zip(self.names, self.shapes, self.sizes, strict=True):
            out[name] = flat[start : start + size].reshape(shape)
            start += size
        return out

    def flatten(self, tensors: dict[str, np.ndarray | torch.Tensor]) -> np.ndarray:
        """name -> array -> one float32 vector, checking every shape."""
        parts = []
        for name, shape in zip(self.names, self.shapes, strict=True):
            if name not in tensors:
                raise DpfleetError(f"missing weight {name!r}")
            t = tensors[name]
            arr = t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)
            if tuple(arr.shape) != shape:
                raise DpfleetError(f"weight {name!r} has shape {arr.shape}, expected {shape}")
            parts.append(arr.reshape(-1).astype(np.float32, copy=False))
        return np.concatenate(parts)


def get_flat(model: nn.Module) -> np.ndarray:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy().copy()


def set_flat(model: nn.Module, flat: np.ndarray) -> None:
    layout = ParamLayout.of(model)
    if flat.shape != (layout.total,):
        raise DpfleetError(f"weight vector has shape {flat.shape}, expected ({layout.total},)")
    src = torch.from_numpy(np.ascontiguousarray(flat, dtype=np.float32))
    with torch.no_grad():  # copy_ (not vector_to_parameters, which would alias `flat`)
        start = 0
        for p, size in zip(model.parameters(), layout.sizes, strict=True):
            p.copy_(src[start : start + size].view_as(p))
            start += size
