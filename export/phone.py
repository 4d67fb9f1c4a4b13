"""Phone exports: an inference program, the tokenizer and a manifest, checked against eager.

The program maps a fixed window of token ids [batch, seq_len] (PAD-filled after the text) to
next-token logits [batch, seq_len, vocab]; a keyboard reads the logits at its last real token.
The ExecuTorch program has batch 1 and runs through the XNNPACK delegate (weights are static
here, so XNNPACK packs them once); the ONNX program has a dynamic batch.

`--quantize int8` is dynamic int8 on the matmul weights: XNNPACK's dynamic per-channel scheme
(pt2e) for ExecuTorch, plus an int8 input embedding table there (`embedding_byte`; untied models),
and ORT's `quantize_dynamic` for ONNX, with `reduce_range=True` for
`--target x86` (without it, the u8 x s8 VPMADDUBSW path of x86 AVX2 saturates and logits drift)
and full 8-bit range for `--target arm` (ARM's int8 dot products do not saturate).

int8 is checked honestly: it needs held-out text (random token ids hide the drop: on a trained
checkpoint ONNX int8 kept 95.8% top-1 on text), top-1 and top-3 agreement with eager go into the
manifest, and an int8 export below `--min-top1` (default 98%) is refused unless
`--accept-int8-drop` is given.
"""

import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dpfleet.edge.model_output import logits_of
from dpfleet.edge.tokenizer import BOS, EOS, PAD, UNK, oov_ids_of
from dpfleet.errors import DpfleetError
from dpfleet.export.checkpoint import load_checkpoint
from dpfleet.export.console_capture import capture, exporter_step, log_path, terminal
from dpfleet.export.manifest import write_manifest
from dpfleet.export.models import ModelConfig
from dpfleet.export.training import tool_versions
from dpfleet.io import make_private, private_mkdir
from dpfleet.progress import progress_bar

PHONE_FORMATS = ("pte", "onnx")
FORMAT_NAMES = {"executorch": "pte"}  # what users also call a format: the runtime's name
QUANTIZE = ("int8",)
PROGRAM_FILE = {"pte": "model.pte", "onnx": "model.onnx"}
TARGETS = ("x86", "arm")
MIN_TOP1 = 0.98


def window_ids(seq_len: int, batch: int = 1) -> torch.Tensor:
    """A [batch, seq_len] window of BOS ids: the example input an exporter traces with."""
    return torch.full((batch, seq_len), BOS, dtype=torch.int64)


def _tied(model: nn.Module) -> bool:
    """Whether the input table is also the output matmul's weight (a zoo config says; a custom
    module shares the Parameter)."""
    cfg = getattr(model, "cfg", None)
    if isinstance(cfg, ModelConfig):
        return cfg.tie_embeddings
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return any(id(m.weight) in tables for m in model.modules() if isinstance(m, nn.Linear))


def quantize_embedding_table(model: nn.Module) -> nn.Module:
    """A copy of `model` whose input table is int8 (symmetric, one scale per row: torchao's
    weight-only int8). ExecuTorch's quant fusion turns its dequantize + embedding into the
    `quantized_decomposed::embedding_byte` kernel, so the table ships as int8 and one row is
    dequantized per token. Tied models keep the fp32 table: it is also the output matmul's weight,
    which the XNNPACK pass quantizes on its own."""
    import copy

    from torchao.quantization import IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerAxis

    quantized = copy.deepcopy(model)
    quantize_(quantized, IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0)),
              filter_fn=lambda module, _: isinstance(module, nn.Embedding))
    return quantized


def pte_program(
    model: nn.Module, seq_len: int, quantize: str | None, quantize_embedding: bool = True
) -> bytes:
    """ExecuTorch inference program (batch 1) lowered to XNNPACK, optionally dynamic int8 matmuls
    and (`quantize_embedding`, untied models) an int8 embedding table."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower

    args = (window_ids(seq_len),)
    with exporter_step("ExecuTorch export"):
        if quantize == "int8":
            import executorch.kernels.quantized  # noqa: F401  (registers embedding_byte for export)
            from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
                XNNPACKQuantizer,
                get_symmetric_quantization_config,
            )
            from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

            if quantize_embedding and not _tied(model):
                model = quantize_embedding_table(model)
            config = get_symmetric_quantization_config(is_per_channel=True, is_dynamic=True)
            graph = torch.export.export(model, args).module()
            graph = prepare_pt2e(graph, XNNPACKQuantizer().set_global(config))
            graph(*args)  # dynamic quantization needs no calibration data; this just runs once
            model = convert_pt2e(graph)
        ep = torch.export.export(model, args)
        lowered = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()])
        fuse = ExecutorchBackendConfig(do_quant_fusion_and_const_prop=quantize == "int8")
        return lowered.to_executorch(fuse).buffer


def onnx_program(
    model: nn.Module, seq_len: int, quantize: str | None, path: Path, reduce_range: bool = True
) -> None:
    """ONNX inference program with a dynamic batch, optionally ORT dynamic int8 (`reduce_range`:
    7-bit weights for x86 AVX2/VNNI-less CPUs; False for ARM)."""
    args = (window_ids(seq_len, batch=2),)
    batch = torch.export.Dim("batch", min=1, max=4096)
    with exporter_step("ONNX export"):
        program = torch.onnx.export(
            model,
            args,
            dynamo=True,
            input_names=["tokens"],
            output_names=["logits"],
            dynamic_shapes=({0: batch},),
            optimize=True,
            verbose=False,
        )
    if quantize != "int8":
        program.save(str(path))
        return
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory() as tmp:
        fp32 = Path(tmp) / "fp32.onnx"
        onnx.save(gemm_to_matmul(program.model_proto), fp32)
        with exporter_step("ONNX int8 quantization"):
            quantize_dynamic(fp32, path, weight_type=QuantType.QInt8, reduce_range=reduce_range)


class LogitsOf(nn.Module):
    """A custom module's forward read as logits (`edge/model_output.py`): a Hugging Face model's
    output object becomes a program's one `logits` output (its parameters are under `model.`)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return logits_of(self.model(tokens))


def window_program_with_weight_inputs(model: nn.Module, seq_len: int, path: Path) -> None:
    """The window program of a phone bundle: tokens [batch, seq_len] and `p.<name>` weights in,
    logits out (`export/weight_inputs.py`: the bundle ships the weights once). A custom module's
    output is read through `LogitsOf`, its weight inputs keep the module's own names."""
    from dpfleet.export.weight_inputs import export_with_weight_inputs

    zoo = isinstance(getattr(model, "cfg", None), ModelConfig)
    module, prefix = (model, "") if zoo else (LogitsOf(model), "model.")
    batch = torch.export.Dim("batch", min=1, max=4096)
    export_with_weight_inputs(module, model, (window_ids(seq_len, batch=2),), ["tokens"], ["logits"],
                              ({0: batch},), path, prefix)


def gemm_to_matmul(model):
    """Rewrite `Gemm(A, W, b, transB=1)` over an initializer W as `MatMul(A, W^T) + b`.

    ORT's dynamic quantizer only quantizes MatMul, and its own Gemm conversion transposes a
    shared initializer once per node, so the unrolled loop's 20 uses of one gate weight come out
    misshapen. Here each weight is transposed once and shared.
    """
    import onnx
    from onnx import helper, numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    transposed: dict[str, str] = {}
    nodes = []
    for node in graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        simple = attrs.get("alpha", 1.0) == 1.0 and attrs.get("beta", 1.0) == 1.0
        if node.op_type != "Gemm" or not simple or attrs.get("transA", 0) or node.input[1] not in inits:
            nodes.append(node)
            continue
        w = node.input[1]
        if attrs.get("transB", 0):
            if w not in transposed:
                transposed[w] = w + ".T"
                graph.initializer.append(
                    numpy_helper.from_array(numpy_helper.to_array(inits[w]).T.copy(), w + ".T")
                )
            w = transposed[w]
        if len(node.input) < 3 or not node.input[2]:
            nodes.append(helper.make_node("MatMul", [node.input[0], w], [node.output[0]]))
            continue
        mm = node.output[0] + ".mm"
        nodes.append(helper.make_node("MatMul", [node.input[0], w], [mm]))
        nodes.append(helper.make_node("Add", [mm, node.input[2]], [node.output[0]]))
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.checker.check_model(model)
    return model


class InferenceProgram:
    """Runs an exported inference program: tokens [b, L] int64 -> logits [b, L, V] float32."""

    def __init__(self, path: Path, fmt: str, threads: int | None):
        self.fmt = fmt
        data = Path(path).read_bytes()
        if fmt == "pte":
            # the runtime kernel of an int8 table (embedding_byte) lives in the quantized library
            import executorch.kernels.quantized  # noqa: F401

            from dpfleet.edge.pte_module import PteModule, set_threads

            set_threads(threads)
            self._pte = PteModule(data, path)
        else:
            from dpfleet.edge.ort_session import load_session

            self._session = load_session(data, path, threads)

    def __call__(self, tokens: np.ndarray) -> np.ndarray:
        if self.fmt == "pte":  # batch-1 program
            rows = [self._pte.run("forward", (torch.from_numpy(r[None]),))[0].numpy().copy() for r in tokens]
            return np.concatenate(rows)
        return self._session.run(None, {"tokens": tokens})[0]


def text_windows(tokenizer, lines: list[str], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Held-out lines as PAD-filled windows [n, seq_len] (BOS first) and their lengths."""
    rows, lengths = [], []
    for line in lines:
        ids = [BOS, *tokenizer.encode(line)][:seq_len]
        if len(ids) < 2:
            continue
        rows.append(ids + [PAD] * (seq_len - len(ids)))
        lengths.append(len(ids))
    if not rows:
        raise DpfleetError("held-out text has no line with at least one token")
    return np.asarray(rows, dtype=np.int64), np.asarray(lengths)


def random_windows(cfg: ModelConfig | int, seq_len: int, n: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """`n` windows of random non-special token ids below the vocabulary (a config or its size)."""
    vocab = cfg if isinstance(cfg, int) else cfg.vocab_size
    rng = np.random.default_rng(0)
    rows = rng.integers(4, vocab, (n, seq_len), dtype=np.int64)
    rows[:, 0] = BOS
    return rows, np.full(n, seq_len)


def agreement(model: nn.Module, program: InferenceProgram, rows: np.ndarray, lengths: np.ndarray) -> dict:
    """Max |logit error|, top-1 agreement (same argmax as eager) and top-3 agreement (eager's
    argmax is among the program's top 3) over the real (non-PAD) positions; ref_max_abs is eager's
    largest |logit| there, the scale the error is judged against (float32 error grows with it)."""
    with torch.no_grad():
        ref = model(torch.from_numpy(rows)).numpy()
    got = program(rows)
    valid = np.arange(rows.shape[1])[None, :] < lengths[:, None]
    err = np.abs(got - ref).max(axis=-1)[valid]
    best = ref.argmax(-1)
    top1 = (got.argmax(-1) == best)[valid]
    top3 = (np.argsort(-got, axis=-1)[..., :3] == best[..., None]).any(-1)[valid]
    return {"max_abs_err": float(err.max()), "ref_max_abs": float(np.abs(ref).max(axis=-1)[valid].max()),
            "top1": float(top1.mean()), "top3": float(top3.mean()),
            "positions": int(valid.sum())}


def latency_ms(program: InferenceProgram, seq_len: int, repeats: int = 30) -> dict:
    """Single-step latency: one [1, seq_len] window in, its logits out."""
    window = window_ids(seq_len).numpy()
    for _ in range(3):
        program(window)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        program(window)
        times.append((time.perf_counter() - t) * 1e3)
    return {"median": float(np.median(times)), "p90": float(np.percentile(times, 90))}


def vocabulary_entry(tokenizer: object) -> dict:
    """The manifest's `vocabulary`: its kind and size and the special ids, read off the tokenizer.
    `oov_ids`: every id unknown text becomes (a word vocabulary's N hash buckets take ids 3 ..
    3+N-1, after which its words start), so an app never offers one of them as a word."""
    return {
        "kind": getattr(tokenizer, "kind", "custom"),
        "size": tokenizer.vocab_size,
        "pad_id": getattr(tokenizer, "pad_id", PAD),
        "bos_id": getattr(tokenizer, "bos_id", BOS),
        "eos_id": getattr(tokenizer, "eos_id", EOS),
        "unk_id": getattr(tokenizer, "unk_id", UNK),
        "oov_ids": list(oov_ids_of(tokenizer)),
    }


@dataclass
class PhoneExport:
    """The inference program of a checkpoint folder, its tokenizer and manifest, checked against
    eager. `model` / `tokenizer`: a custom module (`dpfleet.simulate(model=...)`), whose checkpoint
    has weights but no zoo config to rebuild it from, and the run's tokenizer when the folder's
    cannot be loaded (a caller's own); the folder is still checked (`check_private`) and its
    tokenizer files are shipped. The exporters' output goes to `<out>.export.log` (`console_capture.py`)."""

    checkpoint: Path
    fmt: str
    out: Path
    quantize: str | None = None
    seq_len: int = 20
    threads: int = 1
    heldout: Path | None = None
    target: str = "x86"
    min_top1: float = MIN_TOP1
    accept_int8_drop: bool = False
    pte_int8_embedding: bool = True  # False: the fp32 table of earlier exports (benchmarks compare)
    model: nn.Module | None = None
    tokenizer: object | None = None

    def run(self) -> dict:
        """Export, write tokenizer + manifest, measure; returns the JSON summary, whose `log` is
        the exporters' output file (None when they wrote nothing)."""
        self.fmt = FORMAT_NAMES.get(self.fmt, self.fmt)
        if self.fmt not in PHONE_FORMATS:
            raise DpfleetError(f"unknown format {self.fmt!r}; choose from {', '.join(PHONE_FORMATS)} "
                               "(pte is ExecuTorch's program, also accepted as 'executorch')")
        if self.quantize not in (None, *QUANTIZE):
            raise DpfleetError(f"unknown quantization {self.quantize!r}; choose from {QUANTIZE}")
        cfg, model, tokenizer = self._load()
        longest = cfg.max_length if cfg is not None and cfg.arch == "transformer" else None
        if self.seq_len < 1 or (longest is not None and self.seq_len > longest):
            raise DpfleetError(f"--seq-len must lie in 1..{longest or 'any'} for this model")
        lines = None if self.heldout is None else read_heldout_lines(self.heldout)
        if self.target not in TARGETS:
            raise DpfleetError(f"unknown target {self.target!r}; choose from {TARGETS}")
        if self.quantize and lines is None:
            raise DpfleetError(
                "--quantize int8 needs --heldout text of the checkpoint's domain: agreement on random "
                "token ids hides the int8 drop"
            )
        if self.out.exists() and any(self.out.iterdir()):
            raise DpfleetError(f"output folder {self.out} is not empty")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        private_mkdir(self.out)
        torch.set_num_threads(self.threads)
        with capture(log_path(self.out)) as log:
            try:
                summary = self._export(cfg, model, tokenizer, lines)
                make_private(self.out)  # the permission rule (dpfleet.io), exporters' files too
            except BaseException:
                shutil.rmtree(self.out, ignore_errors=True)  # no half-written export is left behind
                raise
        return {**summary, "log": None if log is None or log.path is None else str(log.path)}

    def _load(self) -> tuple[ModelConfig | None, nn.Module, object]:
        if self.model is None:
            return load_checkpoint(self.checkpoint)
        from dpfleet.edge.tokenizer import load_tokenizer
        from dpfleet.export.checkpoint import TOKENIZER, check_private

        check_private(self.checkpoint)
        if not isinstance(self.model, nn.Module):
            raise DpfleetError(f"model must be a torch.nn.Module, not {type(self.model).__name__}")
        if not (Path(self.checkpoint) / TOKENIZER).is_dir():
            raise DpfleetError(f"{self.checkpoint} is not a checkpoint: missing {TOKENIZER}")
        tokenizer = self.tokenizer if self.tokenizer is not None else load_tokenizer(
            Path(self.checkpoint) / TOKENIZER)
        return None, self.model.eval(), tokenizer

    def _int8_table(self, model: nn.Module) -> bool:
        return self.fmt == "pte" and self.pte_int8_embedding and not _tied(model)

    def _export(self, cfg: ModelConfig | None, model: nn.Module, tokenizer, lines: list[str] | None) -> dict:
        bar = progress_bar(total=3, desc=f"export {self.fmt}", unit="stage", file=terminal())
        program_path = self.out / PROGRAM_FILE[self.fmt]
        with torch.no_grad():
            vocab = int(model(window_ids(self.seq_len)).shape[-1])
        start = time.perf_counter()
        if self.fmt == "pte":
            program_path.write_bytes(pte_program(model, self.seq_len, self.quantize, self.pte_int8_embedding))
        else:
            onnx_program(model, self.seq_len, self.quantize, program_path, self.target == "x86")
        export_s = time.perf_counter() - start
        bar.update()
        shutil.copytree(self.checkpoint / "tokenizer", self.out / "tokenizer")
        bar.update()
        program = InferenceProgram(program_path, self.fmt, self.threads)
        if lines is not None:
            rows, lengths = text_windows(tokenizer, lines, self.seq_len)
            source = str(self.heldout)
        else:
            rows, lengths = random_windows(vocab, self.seq_len)
            source = "random tokens (pass --heldout for text)"
        latency = {**latency_ms(program, self.seq_len), "threads": self.threads}
        agree = {**agreement(model, program, rows, lengths), "text": source}
        del program  # release the program's file before anything is deleted on refusal
        check = self._int8_check(agree)
        architecture = cfg.to_dict() if cfg is not None else {
            "custom": type(model).__qualname__, "parameters": sum(p.numel() for p in model.parameters())}
        manifest = write_manifest(
            self.out,
            {
                "format": self.fmt,
                "quantize": self.quantize,
                "target": self.target,
                "quantization": None if not self.quantize else {
                    "scheme": "dynamic int8 matmul weights" + (
                        " + int8 embedding table (embedding_byte)" if self._int8_table(model) else ""),
                    "reduce_range": self.fmt == "onnx" and self.target == "x86",
                    "int8_check": check,
                },
                "program": program_path.name,
                "architecture": architecture,
                "vocabulary": vocabulary_entry(tokenizer),
                "inputs": {
                    "tokens": {"shape": [1 if self.fmt == "pte" else "batch", self.seq_len], "dtype": "int64"}
                },
                "outputs": {
                    "logits": {
                        "shape": [1 if self.fmt == "pte" else "batch", self.seq_len, vocab],
                        "dtype": "float32",
                    }
                },
                "agreement_with_eager": agree,
                "latency_ms": latency,
                "tools": tool_versions(),
            },
        )
        files = {name: entry["bytes"] for name, entry in manifest["files"].items()}
        bar.update()
        bar.close()
        return {
            "out": str(self.out),
            "format": self.fmt,
            "quantize": self.quantize,
            "architecture": cfg.arch if cfg is not None else type(model).__qualname__,
            "seq_len": self.seq_len,
            "files": files,
            "total_bytes": sum(files.values()),
            "export_seconds": round(export_s, 2),
            "latency_ms": latency,
            "agreement": agree,
            "int8_check": check,
        }

    def _int8_check(self, agree: dict) -> dict | None:
        """The int8 export's agreement check (None for fp32): below --min-top1 the export is
        refused, unless --accept-int8-drop, which the manifest then records."""
        if not self.quantize:
            return None
        check = {"min_top1": self.min_top1, "passed": agree["top1"] >= self.min_top1,
                 "accepted_below_threshold": False}
        if not check["passed"]:
            if not self.accept_int8_drop:
                raise DpfleetError(
                    f"int8 top-1 agreement with eager is {agree['top1']:.4f} (top-3 {agree['top3']:.4f}) "
                    f"over {agree['positions']} held-out positions, below --min-top1 {self.min_top1}; "
                    "export fp32, or pass --accept-int8-drop to write it anyway"
                )
            check["accepted_below_threshold"] = True
        return check


def read_heldout_lines(path: Path) -> list[str]:
    try:
        return [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise DpfleetError(f"cannot read held-out text {path}: {exc}") from exc
