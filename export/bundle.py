"""`dpfleet export CHECKPOINT --bundle DIR`: one signed, self-describing phone bundle.

The bundle holds everything a phone app needs to train and suggest with nothing but ONNX Runtime
(or the ExecuTorch runtime), numpy and SentencePiece: the training program(s), the inference
program, the starting weights, the tokenizer, and `manifest.json`, which spells out every rule
the simulator's devices follow (example rows, minibatch order, SGD, clipping, window) so a client
written without dpfleet can follow it alone; `edge/device_client.py` is the reference client.
The manifest lists every file's sha256 and is signed with Ed25519 (`edge/bundle_format.py`), with
a `bundle_serial` that rises with every export under a key (devices refuse older bundles).
The bundle is assembled in a hidden sibling folder and renamed into place at the end: a failed
export leaves nothing behind. A release policy (`export/policy.py`) is checked before any of
that; the signed manifest's `release_policy` records its rules, its file's sha256 and the values
the run passed.

A custom module (`dpfleet.simulate(model=...)`; `BundleExport(model=...)`, which
`Result.export_bundle` passes) gets the same bundle with its programs exported from the module
itself rather than from a zoo config: no program cache (nothing keys it), and no streaming step
program (one is written per zoo architecture), so its suggestions run the window program. Since no
test has checked its training program before, the export runs one epoch through the reference
client on the signed bundle and compares the delta with the eager loop (`edge/runtime.py`), within
the device-client tolerance; a larger difference refuses the bundle.
"""

from __future__ import annotations

import copy
import os
import platform
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from torch import nn

from dpfleet.edge.bundle_format import (
    BUNDLE_VERSION,
    MANIFEST,
    PUBLIC_KEY,
    SIGNATURE,
    public_key_hex,
    public_key_pem,
    sign_manifest,
    verify_bundle,
)
from dpfleet.edge.tokenizer import BOS, EOS, PAD, UNK
from dpfleet.errors import DpfleetError
from dpfleet.export.bundle_serial import next_serial
from dpfleet.export.checkpoint import (
    TOKENIZER,
    CustomModelCheckpoint,
    check_private,
    checkpoint_caveats,
    load_checkpoint,
    load_weights,
    python_export_hint,
    require_accepted,
)
from dpfleet.export.console_capture import capture, log_path, terminal
from dpfleet.export.models import ModelConfig, count_parameters
from dpfleet.export.params import ParamLayout, get_flat
from dpfleet.export.phone import read_heldout_lines
from dpfleet.export.policy import ReleasePolicy, run_file
from dpfleet.export.training import (
    ModuleProgram,
    ProgramSpec,
    default_program_cache,
    export_module_program,
    onnx_param_name,
    tool_versions,
    training_program,
)
from dpfleet.io import atomic_write, make_private, sha256_hex, write_secret
from dpfleet.progress import progress_bar

BUNDLE_RUNTIMES = ("onnx", "executorch")
WEIGHTS = "weights.bin"
TRAIN_ONNX = "train.onnx"
STEP_ONNX = "step.onnx"
KV_STEP_ONNX = "kv_step.onnx"
TRAIN_PTE = "train.pte"
INFER_ONNX = "infer.onnx"
TOKENIZER_DIR = "tokenizer"
PTE_METHOD = "forward"
ORT_OPS_CONFIG = "ort_required_operators.config"
# A custom module's training program against the eager loop after one epoch (the device client's
# parity tolerance, tests/test_device_client.py): max |delta - eager| <= ATOL + RTOL * max |eager|.
TRAIN_PARITY_ATOL, TRAIN_PARITY_RTOL = 1e-6, 1e-4
TOKENIZER_KINDS = ("sentencepiece", "word")  # what the device client reads (edge/tokenizer.py)

# What the manifest says in words: a client implements these rules, the reference client does.
RULES = {
    "examples": (
        "Tokenise each text of the user; cut its ids into chunks of seq_len; each chunk becomes a "
        "row [bos_id, ids..., pad_id...] of row_length = seq_len + 1 int64 ids. With more than "
        "max_examples rows keep max_examples of them: numpy.random.default_rng(seed).choice(n, "
        "max_examples, replace=False), sorted. Inputs are row[:-1], targets row[1:]."
    ),
    "epoch": (
        "One local epoch: order = numpy.random.default_rng(seed).permutation(n); minibatches are "
        "consecutive slices of batch_size indices of that order (the last may be shorter). Each "
        "minibatch is PAD-filled to seq_len columns (and, for a static-batch program, to its batch "
        "with all-PAD rows: exact, the loss ignores PAD targets)."
    ),
    "loss": "Mean cross-entropy of the next token over positions whose target is not pad_id.",
    "sgd": "After each minibatch: w <- w - lr * g for every parameter (float32, no momentum).",
    "delta": "delta = w_after_epoch - w_start, one float32 vector in the parameters' order.",
    "clipping": (
        "norm = sqrt(sum(delta**2)) accumulated in float64. If norm > clip_norm: delta <- "
        "float32(float64(delta) * clip_norm / norm), then while the float64 norm is still > "
        "clip_norm move every coordinate one float32 ulp toward zero. A delta with any non-finite "
        "value is replaced by zeros. Upload the clipped delta (through secure aggregation)."
    ),
    "weights": (
        "The window and step programs take the model's weights as inputs p.<name> (like the "
        "training program): feed weights.bin, or the latest round's model, or the locally trained one."
    ),
    "window": (
        "Prompt ids p = [bos_id, tokenizer(text)...], keeping at most seq_len - 1 text ids (the "
        "last ones); pad with pad_id to seq_len; run the window program; the next-token logits are "
        "logits[0, len(p) - 1]. Never score pad/bos/eos/unk as suggestions."
    ),
    "step": (
        "Recurrent models: state = (state_h, state_c) zeros of the listed shapes at each new message; "
        "feed bos_id, then each token id of the message; the logits returned after feeding a token "
        "predict the next one. Equal to the window program while the message has at most "
        "seq_len - 1 tokens; past that the state remembers more than the window (trained on rows of "
        "seq_len tokens), and the reference client suggests through the window program, so its "
        "strip is the one a run measures. Keep the state per candidate to score completions: one "
        "step per piece."
    ),
    "kv_step": (
        "Transformer: keys = values = zeros of the listed cache shape at each new message; feed "
        "bos_id at position 0, then each token id at position = the number of tokens fed before "
        "(one cache slot per token, slots = seq_len; the position is shared by the batch); pass "
        "back next_keys / next_values. The logits returned predict the next token and equal the "
        "window program's while the message (BOS included) has at most seq_len tokens. When a "
        "message would need position >= seq_len, use the window program instead (BOS plus the last "
        "seq_len - 1 tokens): positions are absolute learned embeddings trained on 0..seq_len-1, so "
        "the cache cannot slide (dropping the oldest token moves every other token's position and "
        "invalidates every cached key and value), and re-computing it is what one window run does. "
        "Never feed position >= seq_len: the token is then stored nowhere and the logits are wrong."
    ),
    "words": (
        "sentencepiece: a piece starting with U+2581 begins a new word; a word is its first piece "
        "plus the following pieces that do not start with U+2581. word: every id is one word. char: "
        "a word is the characters up to a space or punctuation. The reference client ranks words "
        "with a beam search over tokens (dpfleet/edge/word_search.py), the run's own."
    ),
}


def describe_onnx(data: bytes) -> dict:
    """I/O names, shapes and dtypes, opsets, IR version and the operator list of an ONNX model."""
    import onnx
    from onnx import helper

    model = onnx.load_from_string(data)

    def io(values) -> list[dict]:
        out = []
        for v in values:
            t = v.type.tensor_type
            shape = [d.dim_param if d.dim_param else int(d.dim_value) for d in t.shape.dim]
            dtype = helper.tensor_dtype_to_np_dtype(t.elem_type).name
            out.append({"name": v.name, "shape": shape, "dtype": dtype})
        return out

    init = {i.name for i in model.graph.initializer}
    return {
        "ir_version": int(model.ir_version),
        "opsets": {(o.domain or "ai.onnx"): int(o.version) for o in model.opset_import},
        "ops": sorted({f"{n.domain or 'ai.onnx'}::{n.op_type}" for n in model.graph.node}),
        "inputs": io(v for v in model.graph.input if v.name not in init),
        "outputs": io(model.graph.output),
    }


def ort_operator_config(programs: dict[str, bytes]) -> str:
    """ONNX Runtime's reduced-build operator config (`--include_ops_by_config`) for these programs:
    `domain;since_version;Op,Op` lines, the format of ORT's create_reduced_build_config.py."""
    import onnx
    from onnx import defs

    grouped: dict[tuple[str, int], set[str]] = {}
    for data in programs.values():
        model = onnx.load_from_string(data)
        opsets = {o.domain or "ai.onnx": o.version for o in model.opset_import}
        for node in model.graph.node:
            domain = node.domain or "ai.onnx"
            schema_domain = "" if domain == "ai.onnx" else domain
            since = defs.get_schema(node.op_type, opsets[domain], schema_domain).since_version
            grouped.setdefault((domain, since), set()).add(node.op_type)
    lines = ["# Generated by dpfleet export --bundle from:", *(f"# - {name}" for name in sorted(programs))]
    lines += [f"{d};{v};{','.join(sorted(ops))}" for (d, v), ops in sorted(grouped.items())]
    return "\n".join(lines) + "\n"


def pte_operators(data: bytes) -> list[str]:
    """The operators a `.pte` runs outside its delegates: the selective-build op list."""
    from executorch.codegen.tools.selective_build import _get_program_from_buffer, _get_program_operators

    return sorted(_get_program_operators(_get_program_from_buffer(data)))


def describe_pte(data: bytes, layout: ParamLayout, batch: int, seq_len: int) -> dict:
    """The `.pte` training program's methods and output layout (read from the loaded program)."""
    from dpfleet.edge.pte_module import PteModule

    module = PteModule(data, Path(TRAIN_PTE))
    meta = module.metas[PTE_METHOD]
    n = len(layout.names)
    return {
        "method": PTE_METHOD,
        "methods": sorted(module.methods),
        "batch": batch,
        "inputs": [
            {"name": name, "shape": list(meta.input_tensor_meta(i).sizes()), "dtype": "int64"}
            for i, name in enumerate(("inputs", "targets"))
        ],
        "outputs": {
            "count": int(meta.num_outputs()),
            "loss": 0,
            "gradients": [1, n],
            "parameters": [n + 1, 2 * n],
            "rule": (
                "outputs 1..n are the gradients and n+1..2n the program's own weight tensors, both in "
                "the parameters' order; write the round's weights into the latter (they persist across "
                "runs), then run the method per minibatch and apply SGD to them in place"
            ),
        },
        "backends": ["XnnpackBackend"],
        "portable_operators": pte_operators(data),
        "static_batch": True,
        "seq_len": seq_len,
    }


def load_signing_key(path: Path) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except OSError as exc:
        raise DpfleetError(f"cannot read signing key {path}: {exc.strerror}") from exc
    except (ValueError, TypeError) as exc:
        raise DpfleetError(f"{path}: not an unencrypted PEM private key ({exc})") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise DpfleetError(f"{path}: the signing key must be Ed25519")
    return key


def default_key_path(out: Path) -> Path:
    """Next to the bundle (never inside it): `<parent>/<bundle name>.signing_key.pem`."""
    return out.parent / f"{out.name}.signing_key.pem"


def signing_key(path: Path | None, out: Path) -> tuple[Ed25519PrivateKey, Path, bool]:
    """(key, its file, whether it was generated now). Without --signing-key, reuse the default
    key file when present, otherwise generate one and write it 0600."""
    if path is not None:
        return load_signing_key(path), Path(path), False
    default = default_key_path(out)
    if default.exists():
        return load_signing_key(default), default, False
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    write_secret(default, pem)
    return key, default, True


def _run_json(folder: Path, name: str) -> dict | None:
    """A JSON file of the checkpoint's run (its parent folder), if the run wrote one."""
    return run_file(folder.parent / name)


def _file_entries(folder: Path) -> dict:
    """Every file of the bundle but the manifest and its signature, with its size and SHA-256: what
    the signature covers, so a device can check each file it loads."""
    return {
        p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size,
                                           "sha256": sha256_hex(p.read_bytes())}
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name not in (MANIFEST, SIGNATURE)
    }


@dataclass
class BundleExport:
    checkpoint: Path
    out: Path
    runtimes: tuple[str, ...] = ("onnx",)
    signing_key: Path | None = None
    seq_len: int | None = None  # default: the run's data.seq_len, else 20
    batch_size: int | None = None  # default: the run's client.batch_size, else 16
    threads: int = 1
    cache_dir: Path | None = None
    heldout: Path | None = None  # held-out text lines for the window's agreement (else random ids)
    serial: int | None = None  # bundle_serial; default: next of the key's counter (export/bundle_serial.py)
    # the run's caveats (default: the checkpoint's, `checkpoint_caveats`): a bundle of a run that
    # is not fully private is refused unless accept_caveats; the manifest records them either way
    caveats: list[str] | None = None
    accept_caveats: bool = False
    # a release policy (export/policy.py) the checkpoint's run must meet before anything is
    # written; the manifest records its rules, sha256 and the values the run passed
    policy: ReleasePolicy | None = None
    # a custom module (its checkpoint has weights but no zoo config to rebuild it), holding the
    # checkpoint's weights, and the run's tokenizer when the folder's is not to be read
    model: nn.Module | None = None
    tokenizer: object | None = None

    def run(self) -> dict:
        """Write, sign and self-verify the bundle; returns the JSON summary, whose `log` is the
        exporters' output file (`<bundle>.export.log`; None when they wrote nothing)."""
        for rt in self.runtimes:
            if rt not in BUNDLE_RUNTIMES:
                raise DpfleetError(f"unknown bundle runtime {rt!r}; choose from {BUNDLE_RUNTIMES}")
        out = Path(self.out)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise DpfleetError(f"bundle folder {out} is not empty")
        caveats = checkpoint_caveats(self.checkpoint) if self.caveats is None else self.caveats
        # the policy first: its refusal names the rule (a caveat the policy forbids included)
        self._release = None if self.policy is None else self.policy.check(
            Path(self.checkpoint).parent, caveats)
        self._caveats = require_accepted(caveats, self.accept_caveats, Path(self.checkpoint))
        cfg, model, tokenizer = self._load()
        self._lines = None if self.heldout is None else read_heldout_lines(self.heldout)
        run_cfg = _run_json(Path(self.checkpoint), "config.json") or {}

        def setting(section: str, key: str, default):
            value = run_cfg.get(section, {})
            value = value.get(key, default) if isinstance(value, dict) else default
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise DpfleetError(f"run config {section}.{key} is not a number: {value!r}")
            return value

        client = {
            "lr": float(setting("client", "lr", 0.5)),
            "batch_size": int(self.batch_size or setting("client", "batch_size", 16)),
            "clip_norm": float(setting("dp", "clip_norm", 0.3)),
            "epochs": 1,
            "source": "the checkpoint's run config.json" if run_cfg else "dpfleet defaults (no run config)",
        }
        seq_len = int(self.seq_len or setting("data", "seq_len", 20))
        max_examples = int(setting("data", "max_examples", 256))
        if seq_len < 2 or (cfg is not None and cfg.arch == "transformer" and seq_len > cfg.max_length):
            raise DpfleetError(f"sequence length must lie in 2..{cfg.max_length} for this model")
        if client["batch_size"] < 1:
            raise DpfleetError("batch size must be positive")
        key, key_path, generated = signing_key(self.signing_key, out)
        serial = next_serial(key_path, self.serial)  # before the work: a bad --serial fails fast
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.partial-"))
        with capture(log_path(out)) as log:
            try:
                (staging / PUBLIC_KEY).write_bytes(public_key_pem(key.public_key()))
                manifest = self._write(staging, cfg, model, tokenizer, client, seq_len, max_examples)
                manifest["bundle_serial"] = serial
                self._sign(staging, manifest, key)
                if cfg is None:  # a custom module's training program, checked through the client
                    manifest["measured"]["train_vs_eager"] = self._training_parity(
                        staging, key, model, client, max_examples)
                    self._sign(staging, manifest, key)
                make_private(staging)  # the permission rule (dpfleet.io); hand it on with chmod/cp
                if out.exists():
                    out.rmdir()
                os.replace(staging, out)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
        files = {name: entry["bytes"] for name, entry in manifest["files"].items()}
        return {
            "bundle": str(out),
            "runtimes": list(self.runtimes),
            "files": files,
            "total_bytes": sum(files.values()),
            "public_key": public_key_hex(key.public_key()),
            "bundle_serial": manifest["bundle_serial"],
            "signing_key": str(key_path),
            "signing_key_generated": generated,
            "measured": manifest["measured"],
            "log": None if log is None or log.path is None else str(log.path),
        }

    @staticmethod
    def _sign(folder: Path, manifest: dict, key: Ed25519PrivateKey) -> None:
        blob, signature = sign_manifest(manifest, key)
        atomic_write(folder / MANIFEST, blob)
        atomic_write(folder / SIGNATURE, signature)
        verify_bundle(folder, key.public_key())  # the bundle as a phone will see it

    def _load(self) -> tuple[ModelConfig | None, nn.Module, object]:
        """(zoo config or None, model, tokenizer): the checkpoint's zoo model, or `self.model`."""
        if self.model is None:
            try:
                return load_checkpoint(self.checkpoint)
            except CustomModelCheckpoint as exc:
                raise DpfleetError(
                    f"{exc.folder} holds a custom model ({exc.model_class}) that the command line "
                    "cannot rebuild: "
                    + python_export_hint(exc.folder, exc.model_class, bundle=True)) from None
        from dpfleet.edge.tokenizer import load_tokenizer

        check_private(self.checkpoint)
        if not isinstance(self.model, nn.Module):
            raise DpfleetError(f"model must be a torch.nn.Module, not {type(self.model).__name__}")
        if self.tokenizer is None and not (Path(self.checkpoint) / TOKENIZER).is_dir():
            raise DpfleetError(f"{self.checkpoint} is not a checkpoint: missing {TOKENIZER}")
        tokenizer = self.tokenizer if self.tokenizer is not None else load_tokenizer(
            Path(self.checkpoint) / TOKENIZER)
        if getattr(tokenizer, "kind", None) not in TOKENIZER_KINDS or not hasattr(tokenizer, "save"):
            raise DpfleetError(
                f"a phone bundle ships a tokenizer the device client reads (dpfleet's SentencePiece "
                f"or word tokenizer); this run's is {type(tokenizer).__name__}: train with "
                "dpfleet.edge.tokenizer's WordTokenizer or train_sentencepiece")
        # the folder's weights, into a copy: the bundle ships exactly the checkpoint its privacy
        # checks describe, and the caller's module (its weights, its train/eval mode) is left alone
        what = f"the given {type(self.model).__name__}"
        model = load_weights(self.checkpoint, copy.deepcopy(self.model), what)
        return None, model, tokenizer

    def _write(self, folder: Path, cfg: ModelConfig | None, model, tokenizer, client: dict, seq_len: int,
               max_examples: int) -> dict:
        cache = Path(self.cache_dir) if self.cache_dir else default_program_cache()
        layout = ParamLayout.of(model)
        stages = 3 + ("executorch" in self.runtimes)
        bar = progress_bar(total=stages, desc="bundle", unit="stage", file=terminal())
        flat = get_flat(model).astype("<f4")
        (folder / WEIGHTS).write_bytes(flat.tobytes())
        tokenizer.save(folder / TOKENIZER_DIR)
        training = self._write_training(folder, cfg, model, tokenizer, client, seq_len, layout, cache, bar)
        bar.set_postfix_str("inference program")
        training_mode = model.training
        model.eval()  # a custom module may hold dropout: programs and checks run it as eager eval does
        inference, measured = self._write_inference(folder, cfg, model, tokenizer, seq_len)
        model.train(training_mode)
        bar.update()
        manifest = {
            "bundle_version": BUNDLE_VERSION,
            "created_by": {"dpfleet": tool_versions() | {"python": platform.python_version()}},
            "model": {
                **self._model_entry(cfg, model, seq_len),
                "parameter_count": count_parameters(model),
                "parameters": [{"name": n, "shape": list(s)} for n, s in zip(layout.names, layout.shapes,
                                                                             strict=True)],
            },
            "weights": {"file": WEIGHTS, "dtype": "float32", "byte_order": "little",
                        "count": int(flat.size),
                        "layout": "the parameters concatenated in order, each flattened row-major"},
            "tokenizer": {"folder": TOKENIZER_DIR, "meta": f"{TOKENIZER_DIR}/tokenizer.json",
                          "kind": tokenizer.kind, "vocab_size": tokenizer.vocab_size,
                          "special_ids": {"pad": PAD, "bos": BOS, "eos": EOS, "unk": UNK}},
            "examples": {"seq_len": seq_len, "row_length": seq_len + 1, "max_examples": max_examples,
                         "dtype": "int64"},
            "client": client,
            "training": training,
            "inference": inference,
            "rules": RULES,
            "runtimes": {"onnxruntime": _version("onnxruntime"),
                         "executorch": _version("executorch") if "executorch" in self.runtimes else None,
                         "sentencepiece": _version("sentencepiece"),
                         "note": "versions the bundle was exported and verified with",
                         "ort_reduced_build_config": ORT_OPS_CONFIG},
            "measured": measured,
            "privacy": _run_json(Path(self.checkpoint), "privacy.json"),
            # what the run's guarantee lacks, as accepted at export (coordinator's caveats.py)
            "fully_private": not self._caveats, "caveats": self._caveats,
            **({"release_policy": self._release} if self._release is not None else {}),
        }
        manifest["files"] = _file_entries(folder)
        bar.update()
        bar.close()
        return manifest

    def _write_training(self, folder: Path, cfg: ModelConfig | None, model, tokenizer, client: dict,
                        seq_len: int, layout: ParamLayout, cache: Path, bar) -> dict:
        """The training programs (ONNX always, ExecuTorch when asked: it takes minutes) and the
        manifest's `training` entry that tells a device how to drive each."""
        training: dict = {}
        bar.set_postfix_str("ONNX training program")
        data = self._training_program(cfg, model, tokenizer, seq_len, None, cache)
        (folder / TRAIN_ONNX).write_bytes(data)
        training["onnx"] = {"file": TRAIN_ONNX, "dynamic_batch": True, **describe_onnx(data),
                            "rule": "feed inputs, targets and p.<name> = each weight; get loss and "
                                    "g.<name> = each gradient; apply SGD on the host"}
        bar.update()
        if "executorch" in self.runtimes:
            bar.set_postfix_str("ExecuTorch training program (minutes)")
            batch = client["batch_size"]
            data = self._training_program(cfg, model, tokenizer, seq_len, batch, cache)
            (folder / TRAIN_PTE).write_bytes(data)
            training["pte"] = {"file": TRAIN_PTE, **describe_pte(data, layout, batch, seq_len)}
            bar.update()
        return training

    def _write_inference(self, folder: Path, cfg: ModelConfig | None, model, tokenizer,
                         seq_len: int) -> tuple[dict, dict]:
        """The inference programs (the window and, for a zoo model, the streaming step) with the
        ORT operator list a reduced build needs, and what was measured of them against eager: the
        manifest's `inference` and `measured` entries. `model` is in eval mode."""
        from dpfleet.edge.ort_session import load_session
        from dpfleet.export.phone import (
            LogitsOf,
            agreement,
            latency_ms,
            random_windows,
            text_windows,
            window_program_with_weight_inputs,
        )

        window_program_with_weight_inputs(model, seq_len, folder / INFER_ONNX)
        window = {"file": INFER_ONNX, **describe_onnx((folder / INFER_ONNX).read_bytes()),
                  "seq_len": seq_len, "max_prompt_tokens": seq_len - 1}
        inference = {"window": window}
        weights = {onnx_param_name(n): p.detach().numpy() for n, p in model.named_parameters()}
        session = load_session((folder / INFER_ONNX).read_bytes(), INFER_ONNX, self.threads)

        def program(tokens):
            return session.run(None, {"tokens": tokens, **weights})[0]

        if self._lines is not None:
            rows, lengths = text_windows(tokenizer, self._lines, seq_len)
            source = f"held-out text ({len(rows)} lines)"
        else:
            rows, lengths = random_windows(tokenizer.vocab_size if cfg is None else cfg, seq_len)
            source = "random token windows (pass --heldout for text)"
        measured = {
            "window_vs_eager": {**agreement(LogitsOf(model), program, rows, lengths), "text": source},
            "window_latency_ms": {**latency_ms(program, seq_len), "threads": self.threads},
            "host": {"machine": platform.machine(), "cpu_count": os.cpu_count(),
                     "loadavg_1m": round(os.getloadavg()[0], 2)},
        }
        onnx_files = [TRAIN_ONNX, INFER_ONNX]
        if cfg is not None:  # the zoo's streaming step program (none is written for a custom module)
            key = "kv_step" if cfg.arch == "transformer" else "step"
            inference[key], measured[key] = self._streaming(folder, model, program, seq_len, weights)
            onnx_files.append(inference[key]["file"])
        (folder / ORT_OPS_CONFIG).write_text(
            ort_operator_config({name: (folder / name).read_bytes() for name in onnx_files}))
        return inference, measured

    def _training_program(self, cfg: ModelConfig | None, model: nn.Module, tokenizer, seq_len: int,
                          batch: int | None, cache: Path) -> bytes:
        """The training program's bytes (ONNX for a dynamic batch, `.pte` for a fixed one): the
        zoo's from the shared cache, a custom module's exported from the module in training mode
        (what the eager loop differentiates)."""
        fmt = "onnx" if batch is None else "pte"
        if cfg is not None:
            return training_program(ProgramSpec(cfg, seq_len, batch, fmt), cache).read_verified()
        training_mode = model.training
        try:
            return export_module_program(
                ModuleProgram.of_module(model.train(), seq_len, batch, tokenizer.vocab_size), fmt)
        finally:
            model.train(training_mode)

    @staticmethod
    def _model_entry(cfg: ModelConfig | None, model: nn.Module, seq_len: int) -> dict:
        """The manifest's model: the zoo config, or a custom module's class and vocabulary (the
        logits' last axis, which the device client checks example ids against)."""
        if cfg is not None:
            return {"config": cfg.to_dict()}
        from dpfleet.edge.model_output import logits_of
        from dpfleet.export.phone import window_ids

        with torch.no_grad():
            vocab = int(logits_of(model(window_ids(seq_len))).shape[-1])
        return {"config": None, "vocab_size": vocab,
                "custom": {"class": type(model).__qualname__, "module": type(model).__module__}}

    def _training_parity(self, folder: Path, key: Ed25519PrivateKey, model: nn.Module, client: dict,
                         max_examples: int) -> dict:
        """One epoch of the signed bundle's ONNX training program through the reference client
        against the eager loop (`LocalSGD`) from the same weights; a larger difference than the
        device client's tolerance refuses the bundle (e.g. dropout, which the two draw apart)."""
        from dpfleet.edge.device_client import BundleClient
        from dpfleet.edge.runtime import LocalSGD
        from dpfleet.export.params import get_flat

        bundle = BundleClient(folder, key.public_key())
        rng = np.random.default_rng(0)
        n = min(max_examples, 2 * bundle.batch_size + 1)  # a partial last minibatch too
        rows = rng.integers(4, bundle.tokenizer.vocab_size, (n, bundle.seq_len + 1), dtype=np.int64)
        rows[:, 0] = BOS
        for row, length in zip(rows, rng.integers(2, bundle.seq_len + 2, n), strict=True):
            row[length:] = PAD  # PAD-filled tails, as short texts give
        theta0 = bundle.weights()
        delta = bundle.train_epoch(theta0, rows, seed=0)
        eager = copy.deepcopy(model).train()
        LocalSGD()(eager, torch.from_numpy(rows), lr=client["lr"], batch_size=client["batch_size"], seed=0)
        reference = get_flat(eager) - theta0
        err, scale = float(np.abs(delta - reference).max()), float(np.abs(reference).max())
        bound = TRAIN_PARITY_ATOL + TRAIN_PARITY_RTOL * scale
        if not err <= bound:
            raise DpfleetError(
                f"the exported training program of {type(model).__name__} does not train like eager "
                f"torch: one epoch's delta differs by {err:.3g} (bound {bound:.3g}); a module that "
                "draws random numbers in training (dropout) or keeps batch statistics cannot be "
                "trained from a program")
        return {"max_abs_err": err, "ref_max_abs": scale, "bound": bound, "rows": n,
                "tolerance": f"{TRAIN_PARITY_ATOL} + {TRAIN_PARITY_RTOL} * ref_max_abs"}

    def _streaming(self, folder: Path, model, window, seq_len: int, weights: dict) -> tuple[dict, dict]:
        """Export the step program (recurrent: step.onnx; transformer: the KV-cache step over
        seq_len slots, kv_step.onnx); measure it against the window program and time one step."""
        from dpfleet.edge.ort_session import load_session
        from dpfleet.export.kv_step import cache_shape, empty_cache, kv_step_program, kv_streamed_rows
        from dpfleet.export.streaming import step_latency_ms, step_program, streamed_logits

        cfg = model.cfg
        kv = cfg.arch == "transformer"
        name = KV_STEP_ONNX if kv else STEP_ONNX
        if kv:
            kv_step_program(model, seq_len, folder / name)
        else:
            step_program(model, folder / name)
        session = load_session((folder / name).read_bytes(), name, self.threads)
        rng = np.random.default_rng(0)
        rows = rng.integers(4, cfg.vocab_size, (64, seq_len), dtype=np.int64)
        rows[:, 0] = BOS
        lengths = rng.integers(1, seq_len + 1, 64)  # BOS + at most seq_len - 1 tokens: the agreeing regime
        ref = window(rows)[np.arange(len(rows)), lengths - 1]
        spec = {"file": name, **describe_onnx((folder / name).read_bytes())}
        if kv:
            got = kv_streamed_rows(session, cfg, seq_len, rows, lengths, weights)
            shape: list = list(cache_shape(cfg, seq_len))
            shape[1] = "batch"
            keys, values = empty_cache(cfg, seq_len)
            feed = {"token": np.array([1], np.int64), "position": np.array(0, np.int64), "keys": keys,
                    "values": values}
            spec |= {"slots": seq_len, "cache": {"keys": shape, "values": shape, "dtype": "float32",
                                                 "initial": "zeros"},
                     "position": "int64 scalar: the number of tokens fed before this one (0..slots-1)",
                     "past_slots": "window program (rules.kv_step)"}
        else:
            got = streamed_logits(session, cfg, rows, lengths, weights)
            feed = None
            spec["state"] = {"state_h": [cfg.num_layers, "batch", cfg.projection_dim],
                             "state_c": [cfg.num_layers, "batch", cfg.hidden_dim], "initial": "zeros"}
        measured = {"vs_window_max_abs_err": float(np.abs(got - ref).max()),
                    "vs_window_ref_max_abs": float(np.abs(ref).max()),  # the error's scale
                    "vs_window_top1": float((got.argmax(-1) == ref.argmax(-1)).mean()),
                    "latency_ms": {**step_latency_ms(session, cfg, weights, feed=feed),
                                   "threads": self.threads}}
        return spec, measured


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None
