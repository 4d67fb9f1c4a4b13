"""Training programs: one exported joint forward-backward graph per architecture and shape.

A device trains by running an exported program, not eager torch. The program is exported once per
(architecture, sizes, sequence length, batch, format) and cached under a content hash of exactly
those inputs and the tool versions; weights are never part of the program's identity, since each
round only copies the new weights into it. Two formats:

* `pte` (ExecuTorch): torch.export -> `_export_forward_backward` (the masked loss inside the
  graph) -> `split_addmm` + `dedup_nodes` -> XNNPACK with non-static f32 weights. Static batch:
  the last partial minibatch is padded with PAD rows, which the in-graph mask zeroes exactly.
* `onnx` (plain onnxruntime): the same joint graph re-exported as a module that takes the
  parameters as explicit inputs and returns the loss and the gradients; the host applies SGD.
  (Exporting the joint program to ONNX directly silently yields an empty graph.) Dynamic batch.

Every program file has a sidecar `<file>.json` with its sha256 and parameter layout, which the
runtimes check before handing any bytes to native code.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dpfleet.edge.model_output import logits_of
from dpfleet.edge.tokenizer import PAD
from dpfleet.errors import DpfleetError
from dpfleet.export.console_capture import capture, exporter_step, terminal
from dpfleet.export.graph_passes import dedup_nodes, split_addmm
from dpfleet.export.models import ModelConfig, build_model
from dpfleet.export.params import ParamLayout
from dpfleet.io import atomic_write, private_mkdir, sha256_hex
from dpfleet.jsonio import SPACED, canonical_sha256, write_json
from dpfleet.progress import progress_bar

FORMATS = ("pte", "onnx")
# Bump when the program contents change for the same spec (graph passes, signature, ...).
PROGRAM_VERSION = 2
MAX_DYNAMIC_BATCH = 4096


@dataclass(frozen=True)
class ProgramSpec:
    """Everything that determines a training program (and nothing else: not the weights)."""

    cfg: ModelConfig
    seq_len: int  # model input length L; example rows are L + 1 tokens
    batch: int | None  # None: dynamic batch dimension
    fmt: str

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise DpfleetError(f"unknown program format {self.fmt!r}; choose from {FORMATS}")
        if self.seq_len < 1:
            raise DpfleetError("program sequence length must be positive")
        if self.batch is not None and self.batch < 1:
            raise DpfleetError("program batch size must be positive")
        if self.cfg.arch == "transformer" and self.seq_len > self.cfg.max_length:
            raise DpfleetError(
                f"sequence length {self.seq_len} exceeds the transformer's max_length {self.cfg.max_length}"
            )

    def to_dict(self) -> dict:
        return {"cfg": self.cfg.to_dict(), "seq_len": self.seq_len, "batch": self.batch, "fmt": self.fmt}

    def key(self) -> str:
        """Content hash of the spec, the program version and the exporting tools' versions."""
        spec = {**self.to_dict(), "program_version": PROGRAM_VERSION, "tools": tool_versions()}
        return canonical_sha256(spec, separators=SPACED).hexdigest()[:20]  # cached programs keep their names

    def file_name(self) -> str:
        batch = "dyn" if self.batch is None else f"b{self.batch}"
        return f"train-{self.cfg.arch}-L{self.seq_len}-{batch}-{self.key()}.{self.fmt}"


def tool_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"torch": torch.__version__}
    for pkg in ("executorch", "onnx", "onnxscript"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "absent"
    return out


class LossModule(nn.Module):
    """model + masked next-token loss: the function a device differentiates.

    The loss equals `next_token_loss` but is written as logsumexp(logits) - logit[target]:
    it never materialises the [batch, length, vocab] log-softmax, whose portable ExecuTorch
    kernel is scalar code and took 22% of a Gboard-sized step (exp and the reductions go to
    XNNPACK or are cheap instead).
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = logits_of(self.model(inputs))  # a tensor, or a Hugging Face output's `.logits`
        mask = (targets != PAD).to(logits.dtype)
        picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        nll = torch.logsumexp(logits, dim=-1) - picked
        return (nll * mask).sum() / mask.sum().clamp_min(1.0)


def example_batch(spec: ProgramSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Token inputs and targets of the program's shape (values only steer tracing)."""
    return _example_rows(spec.batch or 2, spec.seq_len, spec.cfg.vocab_size)


def _example_rows(batch: int, seq_len: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, vocab, (batch, seq_len + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


@dataclass(frozen=True)
class ModuleProgram:
    """What a training program is exported from: a module (a zoo model built from its spec, or
    a user's own), the example batch that steers tracing, and whether the batch is dynamic."""

    model: nn.Module
    args: tuple[torch.Tensor, torch.Tensor]
    dynamic_batch: bool

    @classmethod
    def of_spec(cls, spec: ProgramSpec) -> ModuleProgram:
        torch.manual_seed(0)
        return cls(build_model(spec.cfg), example_batch(spec), spec.batch is None)

    @classmethod
    def of_module(cls, model: nn.Module, seq_len: int, batch: int | None, id_limit: int) -> ModuleProgram:
        """A user's module (`dpfleet.simulate(model=...)`); `id_limit`: example ids stay below it
        (the ids the tokenizer produces, which the module's tables index)."""
        return cls(model, _example_rows(batch or 2, seq_len, max(id_limit, 5)), batch is None)


def joint_graph(spec: ProgramSpec | ModuleProgram) -> torch.export.ExportedProgram:
    """The joint forward-backward ExportedProgram (loss + parameter gradients), rewritten."""
    from torch.export.experimental import _export_forward_backward

    source = ModuleProgram.of_spec(spec) if isinstance(spec, ProgramSpec) else spec
    net = LossModule(source.model)
    dynamic = None
    if source.dynamic_batch:
        dim = torch.export.Dim("batch", min=1, max=MAX_DYNAMIC_BATCH)
        dynamic = {"inputs": {0: dim}, "targets": {0: dim}}
    ep = torch.export.export(net, source.args, dynamic_shapes=dynamic)
    ep = _export_forward_backward(ep)
    split_addmm(ep)
    dedup_nodes(ep)
    return ep


def _pte_bytes(source: ModuleProgram, step) -> bytes:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    if source.dynamic_batch:
        raise DpfleetError("ExecuTorch training programs need a fixed batch size")
    ep = joint_graph(source)
    step("lower to XNNPACK")
    # Trainable weights are not static, so XNNPACK takes no matmul unless told to.
    part = XnnpackPartitioner(force_non_static_weights_for_f32_linear=True)
    lowered = to_edge_transform_and_lower(ep, partitioner=[part])
    step("serialize")
    return lowered.to_executorch().buffer


class ParamsAsInputs(nn.Module):
    """Wraps a joint graph so parameters are explicit inputs (the form ONNX export keeps)."""

    def __init__(self, ep: torch.export.ExportedProgram):
        super().__init__()
        self.gm = ep.graph_module
        sig = ep.graph_signature
        self.kinds = []  # per graph placeholder: "param", "user", or a constant's attribute name
        for i, spec in enumerate(sig.input_specs):
            kind = spec.kind.name
            if kind == "PARAMETER":
                self.kinds.append("param")
            elif kind == "USER_INPUT":
                self.kinds.append("user")
            else:  # buffers and lifted constants (the transformer's causal mask) travel along
                value = ep.constants.get(spec.target, None)
                if value is None:
                    value = ep.state_dict[spec.target]
                self.register_buffer(f"const_{i}", value.detach().clone(), persistent=False)
                self.kinds.append(f"const_{i}")

    def forward(self, inputs, targets, *params):
        users, ps = iter((inputs, targets)), iter(params)
        args = [
            next(ps) if k == "param" else next(users) if k == "user" else getattr(self, k) for k in self.kinds
        ]
        return self.gm(*args)


def onnx_param_name(name: str) -> str:
    return "p." + name


def onnx_grad_name(name: str) -> str:
    return "g." + name


def _onnx_bytes(source: ModuleProgram, step) -> bytes:
    ep = joint_graph(source)
    step("export to ONNX")
    wrapper = ParamsAsInputs(ep)
    layout = ParamLayout.of(source.model)
    params = tuple(p.detach() for p in source.model.parameters())
    args = (*source.args, *params)
    batch_dyn = None
    if source.dynamic_batch:
        batch_dyn = {0: torch.export.Dim("batch", min=1, max=MAX_DYNAMIC_BATCH)}
    shapes = (batch_dyn, batch_dyn, tuple(None for _ in params))
    ep2 = torch.export.export(wrapper, args, dynamic_shapes=shapes)
    program = torch.onnx.export(
        ep2,
        args,
        dynamo=True,
        input_names=["inputs", "targets", *map(onnx_param_name, layout.names)],
        output_names=["loss", *map(onnx_grad_name, layout.names)],
        optimize=True,
        verbose=False,
    )
    step("serialize")
    return program.model_proto.SerializeToString()


def export_training_program(spec: ProgramSpec) -> bytes:
    """Export the training program of `spec` (slow: seconds for ONNX, minutes for a Gboard-size
    `.pte`), with a progress bar over its stages (joint graph, lowering, serialization)."""
    return export_module_program(ModuleProgram.of_spec(spec), spec.fmt, f"{spec.cfg.arch}, L={spec.seq_len}")


def export_module_program(source: ModuleProgram, fmt: str, what: str | None = None) -> bytes:
    """The training program of a module (`fmt` "onnx" or "pte"), uncached: a user's module has no
    config to key a cache by, and its export takes seconds. An exporter's refusal is one
    `ExportRefused` line naming the root cause (e.g. the data-dependent branch it cannot trace)."""
    if fmt not in FORMATS:
        raise DpfleetError(f"unknown program format {fmt!r}; choose from {FORMATS}")
    desc = f"export {fmt} training program ({what or type(source.model).__name__})"
    exporter = "ExecuTorch export" if fmt == "pte" else "ONNX export"
    with capture(), progress_bar(total=3, desc=desc, unit="stage", leave=False, file=terminal()) as bar:
        bar.set_postfix_str("joint forward-backward graph")

        def step(stage: str) -> None:
            bar.update()
            bar.set_postfix_str(stage)

        with exporter_step(exporter):
            data = _pte_bytes(source, step) if fmt == "pte" else _onnx_bytes(source, step)
        bar.update()
    return data


@dataclass(frozen=True)
class ProgramFile:
    """A program on disk with the facts the runtimes check before loading it."""

    path: Path
    spec: ProgramSpec
    sha256: str
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def layout(self) -> ParamLayout:
        return ParamLayout(self.names, self.shapes)

    def read_verified(self) -> bytes:
        """The program's bytes, after checking them against the recorded sha256."""
        try:
            data = self.path.read_bytes()
        except OSError as exc:
            raise DpfleetError(f"cannot read program {self.path}: {exc.strerror}") from exc
        if sha256_hex(data) != self.sha256:
            raise DpfleetError(
                f"program {self.path} is corrupt (sha256 differs from {self.path.name}.json); "
                "delete it to re-export"
            )
        return data


def _meta_path(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def write_program(path: Path, spec: ProgramSpec, data: bytes) -> ProgramFile:
    """Write program + sidecar atomically (concurrent workers may share a cache)."""
    layout = ParamLayout.of(build_model(spec.cfg))
    meta = {
        "spec": spec.to_dict(),
        "sha256": sha256_hex(data),
        "names": list(layout.names),
        "shapes": [list(s) for s in layout.shapes],
        "program_version": PROGRAM_VERSION,
        "tools": tool_versions(),
    }
    private_mkdir(path.parent)  # the permission rule (dpfleet/io.py): the cache is the user's
    atomic_write(path, data)
    write_json(_meta_path(path), meta, indent=1)
    return read_program_file(path)


def read_program_file(path: Path) -> ProgramFile:
    """Read a program's sidecar; any problem is a DpfleetError naming the file."""
    path = Path(path)
    meta_file = _meta_path(path)
    if not path.is_file():
        raise DpfleetError(f"program file not found: {path}")
    try:
        meta = json.loads(meta_file.read_text())
        s = meta["spec"]
        spec = ProgramSpec(ModelConfig(**s["cfg"]), int(s["seq_len"]), s["batch"], s["fmt"])
        return ProgramFile(
            path,
            spec,
            str(meta["sha256"]),
            tuple(meta["names"]),
            tuple(tuple(int(d) for d in shape) for shape in meta["shapes"]),
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DpfleetError(f"program {path} has no valid sidecar {meta_file.name}: {exc}") from exc


def default_program_cache() -> Path:
    """The user's shared program cache, `$XDG_CACHE_HOME/dpfleet/programs` (~/.cache by default).
    Programs are keyed by content (`ProgramSpec.key`), so every run and every bundle of the same
    shape shares one export."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "dpfleet" / "programs"


def training_program(spec: ProgramSpec, cache_dir: Path) -> ProgramFile:
    """The cached program of `spec`, exporting it on first use.

    An export holds an advisory lock on `<file>.lock`, so a second process asking for the same
    program waits for it and then reads the cache instead of exporting it again.
    """
    path = Path(cache_dir) / spec.file_name()
    if path.is_file() and _meta_path(path).is_file():
        return read_program_file(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _export_lock(path.with_name(path.name + ".lock")):
        if path.is_file() and _meta_path(path).is_file():  # exported while we waited
            return read_program_file(path)
        return write_program(path, spec, export_training_program(spec))


@contextlib.contextmanager
def _export_lock(lock: Path):
    try:
        import fcntl
    except ImportError:  # no advisory locks (Windows): concurrent exports only waste time
        yield
        return
    with open(lock, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
