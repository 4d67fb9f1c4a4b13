"""Public training with distillation: L_pub = L_LM + beta * L_KD over a top-k corpus (paper 000
Sec. 4.1), from any starting theta.

One loop serves both places public training happens in paper 000: *pre*-training before the first
private round (theta = the seeded init) and *mid*-training between the two DP-FTRL stages of
Algorithm 1 (theta = the DP checkpoint at round T'). It trains on a subset of a corpus's
sequences (all of them, a random q, or the distribution-matched q) and beta = 0 is plain L_LM.
Public data only, so it costs no privacy. Adam with gradient clipping at 1, like pretrain.py.

Precision. `KDTrainConfig.precision` "bfloat16" runs the forward (and so the backward) under
bfloat16 autocast where the CPU does it natively (`dpfleet.edge.precision`); the weights, the
gradient clipping and Adam's state stay float32. The resolved name is part of the config, so a
cached or resumed result is never one of another precision.

Device. The student trains on `KDTrainConfig.device`, CPU by default, chosen on purpose and
never picked up from whatever accelerator is present: the small recurrent students step one
time position at a time, a launch-bound loop on a GPU, and CPU kernels give the bit-exact
resume the tests check (tests run on 1 torch thread). On CUDA, the same result after an
interruption additionally needs deterministic kernels, which the caller sets before training:
`CUBLAS_WORKSPACE_CONFIG=:4096:8` in the environment and `torch.use_deterministic_algorithms(True)`
(cuDNN's recurrent kernels then raise rather than drift); resume on another device than the
one the state was saved on is refused (the device is part of the job's fingerprint). The
teacher, by contrast, uses the accelerator whenever there is one (public/teacher.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dpfleet.edge.precision import resolve_precision
from dpfleet.edge.tokenizer import BOS, PAD
from dpfleet.errors import DpfleetError
from dpfleet.export.models import ModelConfig, build_model
from dpfleet.export.params import get_flat, set_flat
from dpfleet.io import atomic_write
from dpfleet.public.kd import public_loss
from dpfleet.public.topk import KDBatch


@dataclass(frozen=True)
class KDTrainConfig:
    steps: int = 200
    batch_size: int = 32
    lr: float = 3e-3  # Adam
    beta: float = 0.1  # weight of L_KD; 0 = plain next-token loss
    temperature: float = 1.0
    seed: int = 0
    device: str = "cpu"  # the student's device (see the module docstring)
    precision: str = "float32"  # the forward/backward GEMMs: "float32" | "bfloat16" | "auto" (edge.precision)


class PlainCorpus:
    """Token sequences without teacher labels, batched like `TopKCorpus` (L_KD is then 0)."""

    def __init__(self, sequences: Sequence[Sequence[int]]):
        self.sequences = [list(s) for s in sequences]

    def __len__(self) -> int:
        return len(self.sequences)

    def batch(self, indices: Sequence[int]) -> KDBatch:
        seqs = [self.sequences[i] for i in indices]
        width = max(map(len, seqs))
        targets = torch.full((len(seqs), width), PAD, dtype=torch.long)
        inputs = torch.full((len(seqs), width), PAD, dtype=torch.long)
        for b, s in enumerate(seqs):
            targets[b, : len(s)] = torch.as_tensor(s)
            inputs[b, 0] = BOS
            inputs[b, 1 : len(s)] = torch.as_tensor(s[:-1])
        ids = torch.full((len(seqs), width, 1), PAD, dtype=torch.long)
        return KDBatch(inputs, targets, ids, torch.full(ids.shape, float("-inf")))


def student_device(name: str) -> torch.device:
    """The configured student device, checked: a missing accelerator is a user error."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise DpfleetError(f"unknown student device {name!r} (cpu, cuda, cuda:1, ...)") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DpfleetError(f"student device {name!r} requested but no CUDA device is available")
    if device.type not in ("cpu", "cuda"):
        raise DpfleetError(f"student device {name!r}: only cpu and cuda are supported")
    return device


def _losses(model: torch.nn.Module, batch: KDBatch, beta: float, temperature: float, device):
    inputs, targets, ids, logits = (t.to(device) for t in
                                    (batch.inputs, batch.targets, batch.topk_ids, batch.topk_logits))
    return public_loss(model(inputs), targets, ids, logits, beta, temperature, PAD)


def kd_train(
    model_cfg: ModelConfig,
    theta: np.ndarray,
    corpus,
    indices: Sequence[int] | None,
    cfg: KDTrainConfig,
    *,
    progress: bool = True,
    desc: str = "public training",
    state_file: Path | None = None,
    save_every: int = 100,
) -> tuple[np.ndarray, list[dict]]:
    """Train from `theta` on `corpus` sequences `indices` (all when None) for `cfg.steps` steps.

    `corpus` is a `TopKCorpus` or a `PlainCorpus`. Returns the new flat weights and a short
    history of smoothed (L_pub, L_LM, L_KD). With `state_file`, the whole training state (model,
    Adam, the batch sampler, step) is saved there every `save_every` steps, and a run that finds
    one continues from it: the result is the same as without the interruption.
    """
    pool = np.arange(len(corpus)) if indices is None else np.asarray(indices, dtype=np.int64)
    if len(pool) == 0:
        raise DpfleetError("public training got no sequences (raise the fraction q)")
    if cfg.beta < 0 or cfg.steps < 0:
        raise DpfleetError("public training needs beta >= 0 and steps >= 0")
    device = student_device(cfg.device)
    precision = resolve_precision(cfg.precision, device.type)
    torch.manual_seed(cfg.seed)
    model = build_model(model_cfg)
    set_flat(model, theta)
    if cfg.steps == 0:
        return get_flat(model), []
    model.to(device).train()
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    rng = np.random.default_rng(cfg.seed)
    if progress:
        from dpfleet.progress import progress_bar

        bar = progress_bar(total=cfg.steps, desc=f"{desc} ({device})", unit="step", leave=False,
                           terminal_only=False)
    history, ema, start = [], None, 0
    fingerprint = _fingerprint(model_cfg, cfg, pool)
    if state_file is not None and Path(state_file).is_file():
        start, ema, history = _load_state(Path(state_file), fingerprint, model, opt, rng)
    if progress:
        bar.update(start)
    for step in range(start, cfg.steps):
        batch = corpus.batch(rng.choice(pool, size=min(cfg.batch_size, len(pool)), replace=False))
        with precision.autocast(device.type):
            loss, lm, kd = _losses(model, batch, cfg.beta, cfg.temperature, device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        now = np.array([loss.item(), lm.item(), kd.item()])
        ema = now if ema is None else 0.9 * ema + 0.1 * now
        if step == 0 or (step + 1) % max(1, cfg.steps // 10) == 0:
            history.append({"step": step + 1, "loss": ema[0], "lm": ema[1], "kd": ema[2]})
        if progress:
            bar.update()
            kd = {"kd": f"{ema[2]:.3f}"} if cfg.beta > 0 else {}  # beta 0: plain LM, no teacher
            bar.set_postfix(lm=f"{ema[1]:.3f}", **kd, refresh=False)
        if state_file is not None and (step + 1) % save_every == 0 and step + 1 < cfg.steps:
            _save_state(Path(state_file), fingerprint, step + 1, model, opt, rng, ema, history)
    if progress:
        bar.close()
    model.to("cpu")
    return get_flat(model), history


def _fingerprint(model_cfg: ModelConfig, cfg: KDTrainConfig, pool: np.ndarray) -> str:
    parts = repr((dataclasses.asdict(model_cfg), dataclasses.asdict(cfg), pool.tolist()))
    return hashlib.sha256(parts.encode()).hexdigest()


def _save_state(path: Path, fingerprint: str, step: int, model, opt, rng, ema, history) -> None:
    state = {"fingerprint": fingerprint, "step": step, "model": model.state_dict(),
             "optimizer": opt.state_dict(), "rng": rng.bit_generator.state,
             "ema": [float(v) for v in ema],
             "history": [{k: float(v) for k, v in h.items()} for h in history]}
    atomic_write(path, lambda f: torch.save(state, f))


def _load_state(path: Path, fingerprint: str, model, opt, rng) -> tuple[int, np.ndarray, list[dict]]:
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("fingerprint") != fingerprint:
        raise DpfleetError(f"{path} is the training state of another job (other model, settings or "
                           "data); delete it or use another output folder")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    rng.bit_generator.state = state["rng"]
    return state["step"], np.array(state["ema"]), state["history"]


@torch.no_grad()
def kd_evaluate(model_cfg: ModelConfig, theta: np.ndarray, corpus, indices: Sequence[int],
                temperature: float = 1.0, batch_size: int = 256) -> dict:
    """Mean L_LM and L_KD of `theta` on `corpus` sequences `indices` (position-weighted)."""
    model = build_model(model_cfg)
    set_flat(model, theta)
    model.eval()
    totals, weight = np.zeros(2), 0
    idx = np.asarray(indices)
    for start in range(0, len(idx), batch_size):
        batch = corpus.batch(idx[start : start + batch_size])
        _, lm, kd = _losses(model, batch, 0.0, temperature, torch.device("cpu"))
        n = int((batch.targets != PAD).sum())
        totals += n * np.array([lm.item(), kd.item()])
        weight += n
    return {"lm": totals[0] / weight, "kd": totals[1] / weight}
