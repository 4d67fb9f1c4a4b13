"""The teacher's top-k on a CPU: an int8 screen over the whole vocabulary, then exact float32.

Gemma-3-270M spends more flops in its LM head (262,144 x 640) than in its transformer body, and
a float32 head runs at this CPU's sgemm speed. A top-k does not need every logit exactly, only
the k largest: so the head runs as an int8 x int8 GEMM (oneDNN's u8s8 kernel, VNNI where the
CPU has it, bfloat16 output where oneDNN has BF16 kernels to halve the memory it writes), each
row's best `candidates` ids are taken from those approximate logits, and only those ids are
scored again in float32 (a gather of `candidates` weight rows, the same dot products the float32
head computes). The returned values are therefore the float32 teacher's logits; the screen can
only err by leaving a true top-k id out of the candidates, which
`tests/test_public_teacher_screen.py` and the benchmark (`benchmarks/public_topk.py
--agreement`) measure against the float32 head.

Why activations get 7 bits on a CPU without VNNI: there oneDNN multiplies u8 x s8 pairs with
`vpmaddubsw`, which saturates the sum of two products at 32,767; with u8 up to 255 and weights
up to 127 the sum reaches 64,770 and the logits come out wrong (measured: max error 2.8 on
unit-scale logits, AMD EPYC AVX2). Activations in [1, 127] keep every pair below 32,258
(the reduced range PyTorch's own x86 quantization uses on such CPUs). VNNI sums in int32.

Why each row is scaled to max |h| = 1 before quantization: one activation scale is shared by a
chunk, and a row with a small norm would otherwise use few of the 255 levels. The per-row
factor is positive, so it does not change the order of that row's logits, which is all a
screen needs. Weights are quantized per output row (its own scale).

The candidates are found in two steps without sorting 262,144 values per row: the vocabulary
is cut into groups of 128 ids, the best `candidates` groups by their maximum hold every one of
the row's best `candidates` values (a group outside them has a maximum below `candidates`
others), and the top-k of those groups' values are the candidates.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dpfleet.errors import DpfleetError

GROUP = 128
DEFAULT_CANDIDATES = 32  # all 10 of 5,120 real rows' top-10 kept (the benchmark's --agreement)
SCREEN_CHUNK_TOKENS = 256  # rows per int8 GEMM: the fastest of 128..1024 on 2 cores


def int8_gemm_available() -> bool:
    """oneDNN's quantized linear is built into this torch (x86 CPU builds)."""
    return bool(torch.backends.mkldnn.is_available()
                and hasattr(torch.ops.onednn, "qlinear_pointwise"))


def screen_output_dtype() -> torch.dtype:
    """bfloat16 where oneDNN has BF16 kernels (AVX512 and up), float32 elsewhere: on an AVX2 CPU
    oneDNN writes bfloat16 through its reference kernel, measured 2,400x slower than float32
    output (400 s against 0.17 s for a 256 x 32,768 x 640 screen, AMD EPYC, 1 thread)."""
    bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return torch.bfloat16 if bf16 else torch.float32


def cpu_has_vnni() -> bool:
    """AVX512-VNNI or AVX-VNNI: int8 dot products in one instruction, where the screen pays off."""
    probe = getattr(torch.cpu, "_is_vnni_supported", None)
    if probe is not None:
        return bool(probe())
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags


class Int8Screen:
    """An LM head's weight prepared for the int8 screen, plus the float32 weight for rescoring.

    `weight` [vocab, hidden] float32 (and `bias`, `softcap` as the model's own head applies them).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 softcap: float | None = None, candidates: int = DEFAULT_CANDIDATES):
        if not int8_gemm_available():
            raise RuntimeError("this torch build has no oneDNN quantized linear")
        self.weight = weight.detach().float()
        self.bias = None if bias is None else bias.detach().float()
        self.softcap = softcap
        self.vocab = int(self.weight.shape[0])
        self.candidates = min(candidates, self.vocab)
        groups = -(-self.vocab // GROUP)
        padded = torch.zeros(groups * GROUP, self.weight.shape[1])
        padded[: self.vocab] = self.weight
        if self.bias is not None:  # the screen ranks h.w + b: fold b in as one more input column
            padded = torch.cat([padded, torch.zeros(len(padded), 1)], 1)
            padded[: self.vocab, -1] = self.bias
        scale = padded.abs().amax(1).clamp_min(1e-12) / 127
        self._w_scale = scale
        self._w_zero = torch.zeros(len(padded), dtype=torch.int32)
        self._packed = torch.ops.onednn.qlinear_prepack(
            (padded / scale[:, None]).round().to(torch.int8), None)
        self._groups = groups
        self._out_dtype = screen_output_dtype()
        self._levels = 127 if cpu_has_vnni() else 63  # per sign; 7 bits without VNNI (above)

    def approximate(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, groups x 128] logits in `screen_output_dtype()`, each row scaled by a positive
        factor (order kept), padding ids at -inf."""
        h = hidden.float()
        if self.bias is not None:
            h = torch.cat([h, torch.ones(len(h), 1)], 1)
        h = h / h.abs().amax(1, keepdim=True).clamp_min(1e-12)
        levels = self._levels
        quantized = (h * levels).round().add_(levels + 1).to(torch.uint8)  # zero point levels+1
        out = torch.ops.onednn.qlinear_pointwise(
            quantized, 1 / levels, levels + 1, self._packed, self._w_scale, self._w_zero, None, 1.0, 0,
            self._out_dtype, "none", [], "")
        if self.vocab < out.shape[1]:
            out[:, self.vocab:] = float("-inf")
        return out

    def candidate_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        """int64 [rows, candidates]: each row's best ids by the approximate logits."""
        approx = self.approximate(hidden).view(len(hidden), self._groups, GROUP)
        m = self.candidates
        best_groups = approx.amax(-1).topk(min(m, self._groups), dim=-1).indices
        members = approx.gather(1, best_groups[:, :, None].expand(-1, -1, GROUP))
        within = members.reshape(len(hidden), -1).topk(m, dim=-1).indices
        return best_groups.gather(1, within // GROUP) * GROUP + within % GROUP

    def exact(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """float32 logits of `ids` [rows, m] (bias and softcap as the model's head)."""
        logits = torch.einsum("rd,rmd->rm", hidden.float(), self.weight[ids])
        if self.bias is not None:
            logits += self.bias[ids]
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def topk(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, teacher ids) [rows, k], best first: float32 logits of the screened top-k."""
        ids = self.candidate_ids(hidden)
        values, order = self.exact(hidden, ids).topk(min(k, ids.shape[1]), dim=-1)
        return values, ids.gather(1, order)


HEADS = ("auto", "float32", "int8")


def resolve_head(head: str, teacher, targets: str) -> str:
    """The head a top-k job runs: "int8" (the screen) or "float32".

    "auto" takes the screen on a CPU with VNNI for teacher-space targets; elsewhere (CUDA, whose
    float32 head runs as TF32; a CPU without int8 dot products, where the screen gains little;
    student-space targets, which need every logit's mass) the float32 head.
    """
    if head not in HEADS:
        raise DpfleetError(f"head must be one of {', '.join(HEADS)}, not {head!r}")
    on_cpu = teacher.device.type == "cpu"
    if head == "int8":
        if not on_cpu or targets != "teacher" or not int8_gemm_available():
            raise DpfleetError("the int8 head screens a teacher-space top-k on a CPU with oneDNN "
                               "(targets = teacher, device = cpu); use --head float32")
        return "int8"
    if head == "auto" and on_cpu and targets == "teacher" and int8_gemm_available() \
            and cpu_has_vnni():
        return "int8"
    return "float32"


def screen_for(teacher, candidates: int = DEFAULT_CANDIDATES) -> Int8Screen:
    """The screen of a loaded teacher's LM head (its bias and final logit softcap included)."""
    bias = getattr(teacher.model.get_output_embeddings(), "bias", None)
    cap = getattr(teacher.model.config, "final_logit_softcapping", None)
    return Int8Screen(teacher.head_weight, bias, cap, candidates)
