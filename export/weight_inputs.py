"""ONNX programs that take the model's weights as inputs instead of baking them in.

A phone bundle ships the weights once (`weights.bin`, the flat layout of `export/params.py`) and
its window and step programs read them as `p.<name>` inputs, like the training program: the
programs stay a few KB, and suggestions use whatever model the phone holds now (each round's
weights, or its own locally trained ones) without a new program. Measured at Gboard's CIFG size:
a streaming step with weight inputs takes ~10% longer than with baked weights (ORT cannot prepack
them), and the bundle is ~3x smaller.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.func import functional_call

from dpfleet.export.console_capture import exporter_step
from dpfleet.export.training import onnx_param_name


class WeightInputs(nn.Module):
    """`module(*inputs)` with its parameters passed as trailing arguments (in `named_parameters`
    order of `params_of`, under `prefix` inside `module`)."""

    def __init__(self, module: nn.Module, params_of: nn.Module, prefix: str = ""):
        super().__init__()
        self.module = module
        self.names = [prefix + n for n, _ in params_of.named_parameters()]

    def forward(self, *args):
        n = len(self.names)
        inputs, params = args[: len(args) - n], args[len(args) - n :]
        return functional_call(self.module, dict(zip(self.names, params, strict=True)), inputs)


def export_with_weight_inputs(
    module: nn.Module,
    params_of: nn.Module,
    args: tuple,
    input_names: list[str],
    output_names: list[str],
    dynamic_shapes: tuple,
    path: Path,
    prefix: str = "",
) -> None:
    """Export `module(*args)` to ONNX at `path` with `p.<name>` weight inputs after `input_names`."""
    names = [n for n, _ in params_of.named_parameters()]
    params = tuple(p.detach() for p in params_of.parameters())
    wrapper = WeightInputs(module, params_of, prefix).eval()
    with exporter_step("ONNX export"):
        ep = torch.export.export(wrapper, (*args, *params),
                                 dynamic_shapes=((*dynamic_shapes, *(None for _ in params)),))
        program = torch.onnx.export(ep, (*args, *params), dynamo=True,
                                    input_names=[*input_names, *map(onnx_param_name, names)],
                                    output_names=output_names, optimize=True, verbose=False)
    program.save(str(path))
