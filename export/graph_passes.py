"""Graph rewrites that make an exported joint forward-backward graph fast on a mobile runtime.

Measured on ExecuTorch 1.5.1 (issue 4): the portable `addmm` kernel is a naive triple loop, so
`addmm` becomes `mm` + `add` (XNNPACK then takes the matmul); the unrolled recurrent loop repeats
identical nodes every step (the transposed recurrent weight, the bias views, ...), so identical
pure nodes are merged, which both shrinks the program and makes lowering faster.
"""

from __future__ import annotations

import torch
from torch.export import ExportedProgram
from torch.fx import Node

aten = torch.ops.aten

# Ops whose repeated calls must not be merged (random or in-place).
_IMPURE = {"rand", "randn", "randint", "bernoulli", "dropout", "native_dropout", "rand_like"}


def split_addmm(ep: ExportedProgram) -> int:
    """Rewrite every `aten.addmm(bias, a, b)` (beta = alpha = 1) as `add(mm(a, b), bias)`."""
    graph = ep.graph_module.graph
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != aten.addmm.default:
            continue
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
            continue
        bias, a, b = node.args[:3]
        with graph.inserting_before(node):
            mm = graph.call_function(aten.mm.default, (a, b))
            mm.meta = dict(node.meta)
            add = graph.call_function(aten.add.Tensor, (mm, bias))
            add.meta = dict(node.meta)
        node.replace_all_uses_with(add)
        graph.erase_node(node)
        count += 1
    _finish(ep)
    return count


def _key(node: Node) -> tuple | None:
    if node.op != "call_function":
        return None
    name = getattr(node.target, "__name__", str(node.target))
    if any(bad in name for bad in _IMPURE) or name.endswith("_"):
        return None

    def norm(a):
        if isinstance(a, Node):
            return ("node", id(a))
        if isinstance(a, list | tuple):
            return (type(a).__name__, tuple(norm(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple(sorted((k, norm(v)) for k, v in a.items())))
        return ("const", type(a).__name__, repr(a))

    return (node.target, norm(node.args), norm(node.kwargs))


def dedup_nodes(ep: ExportedProgram) -> int:
    """Merge identical pure nodes (same op, same inputs) of a functional graph and drop aliases
    that feed only other ops (each is a partition break for XNNPACK); returns nodes removed."""
    graph = ep.graph_module.graph
    output = graph.output_node()
    seen: dict[tuple, Node] = {}
    removed = 0
    for node in list(graph.nodes):
        if node.target == aten.alias.default and output not in node.users:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            removed += 1
            continue
        key = _key(node)
        if key is None:
            continue
        first = seen.setdefault(key, node)
        if first is not node:
            node.replace_all_uses_with(first)  # later users now name `first` in their keys
            graph.erase_node(node)
            removed += 1
    _finish(ep)
    return removed


def _finish(ep: ExportedProgram) -> None:
    """Keep the signature's output names in step with the (possibly renamed) output node."""
    graph = ep.graph_module.graph
    graph.eliminate_dead_code()
    out = graph.output_node()
    for spec, arg in zip(ep.graph_signature.output_specs, out.args[0], strict=True):
        if hasattr(spec.arg, "name") and isinstance(arg, Node):
            spec.arg.name = arg.name
    ep.graph_module.recompile()
