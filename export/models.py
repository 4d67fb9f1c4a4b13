"""The on-device language-model zoo.

All models map token ids [batch, length] to next-token logits [batch, length, vocab]. By default
the input and output embeddings are separate, as in Gboard's CIFG (paper 002 Sec. 1: 670 hidden,
input and output embeddings of 96, 2.4M parameters at a 10K vocabulary; Sec. 2.3: with shared
embeddings, fine-tuning from a pretrained model was challenging, so Gboard's models keep them
separate). `tie_embeddings = true` reads the logits through the input embedding's transpose
plus a bias (Press & Wolf 2017): one table instead of two, 1.42M parameters at that size, a
smaller phone model that may fine-tune worse from public pretraining. They are written with
plain matmuls and an explicit, unrolled time loop instead of `nn.LSTM`, because the same module
is exported to ExecuTorch and ONNX training programs: the loop unbinds the time axis once and
the recurrent weights are applied as one fused matmul per step, which keeps the exported graph
free of per-step slicing copies.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from dpfleet.errors import DpfleetError

ARCHITECTURES = ("cifg", "lstm", "transformer")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture and sizes. Defaults are Gboard's CIFG (paper 002 Sec. 1, untied)."""

    arch: str = "cifg"
    """"cifg" (coupled input-forget gate LSTM, Gboard's) | "lstm" | "transformer"."""
    vocab_size: int = 10_000
    """Output classes; a run sets it from its tokenizer's vocab_size."""
    embedding_dim: int = 96
    """The input embedding's width."""
    hidden_dim: int = 670
    """Recurrent models: the cell's hidden state; the transformer: its MLP's width."""
    projection_dim: int = 96
    """Recurrent models project the hidden state back to this size."""
    num_layers: int = 1
    """Stacked recurrent cells or transformer blocks."""
    num_heads: int = 4
    """Attention heads (transformer only)."""
    max_length: int = 32
    """The transformer's positional table; sequences are <= data.seq_len tokens + bos."""
    tie_embeddings: bool = False
    """logits = h @ embed^T + bias: one vocab x dim table instead of two (recurrent models need
    projection_dim == embedding_dim)."""
    preset: str = ""
    """A named size from the zoo's `PRESETS` ("gboard_cifg": Gboard's CIFG 96 / 670 / 96, tied, 1.42M
    parameters at TFF's 10,004-token StackOverflow vocabulary); a key the config also states must
    agree with it. "": none."""

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise DpfleetError(f"unknown architecture {self.arch!r}; choose from {ARCHITECTURES}")
        for name in ("vocab_size", "embedding_dim", "hidden_dim", "projection_dim", "num_layers"):
            if getattr(self, name) < 1:
                raise DpfleetError(f"model.{name} must be positive")
        if self.arch == "transformer" and self.embedding_dim % self.num_heads:
            raise DpfleetError("model.embedding_dim must be divisible by model.num_heads")
        if self.tie_embeddings and self.arch != "transformer" and self.projection_dim != self.embedding_dim:
            raise DpfleetError(
                "model.tie_embeddings needs model.projection_dim == model.embedding_dim "
                f"(got {self.projection_dim} and {self.embedding_dim})"
            )

    def to_dict(self) -> dict:
        return asdict(self)


# Named sizes a config can ask for by `[model] preset = NAME`. "gboard_cifg" is the model of Hard et
# al. 2018 (Sec. 3: CIFG, 670 units, projection and embeddings 96, input and output embeddings tied,
# 1.4M parameters), which is also the TFF StackOverflow baselines' 96 / 670 / 96 shape (theirs is an
# untied plain LSTM: 4,050,748 parameters). At the 10,000 words + 1 OOV bucket + PAD / BOS / EOS of
# TFF's vocabulary it has 1,422,638 parameters (tests/test_gboard_model.py counts them by hand).
PRESETS: dict[str, dict[str, object]] = {
    "gboard_cifg": {"arch": "cifg", "embedding_dim": 96, "hidden_dim": 670, "projection_dim": 96,
                    "num_layers": 1, "tie_embeddings": True},
}


def with_preset(model: dict) -> dict:
    """A raw `[model]` table with its `preset`'s sizes filled in. A key the table also states must
    agree: a run records its preset, so a model that differs from it (say a `--set model.preset`
    on a file that states smaller sizes) would be mislabelled. For a variant, drop the preset and
    state the keys."""
    name = model.get("preset")
    if not name:
        return model
    if name not in PRESETS:
        raise DpfleetError(f"unknown model.preset {name!r}; choose from {tuple(PRESETS)}")
    for key, value in PRESETS[name].items():
        if key in model and model[key] != value:
            raise DpfleetError(f"model.preset = {name!r} sets model.{key} = {value!r}, but the config "
                               f"states {model[key]!r}: remove one of them")
    return {**PRESETS[name], **model}


def output_logits(model: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """Hidden states -> logits: the model's own output Linear, or, with tied embeddings, the
    input table's transpose plus `output_bias`. The table stays one parameter registered once
    (`embed.weight`), so exports, safetensors and `functional_call` never see a shared tensor,
    and untied checkpoints keep their `output.weight` / `output.bias` names."""
    if model.cfg.tie_embeddings:
        return nn.functional.linear(h, model.embed.weight, model.output_bias)
    return model.output(h)


def _add_output(model: nn.Module, dim: int, cfg: ModelConfig) -> None:
    if cfg.tie_embeddings:
        model.output_bias = nn.Parameter(torch.zeros(cfg.vocab_size))
    else:
        model.output = nn.Linear(dim, cfg.vocab_size)


class RecurrentCell(nn.Module):
    """One LSTM layer with a projection; `coupled=True` gives CIFG (input gate = 1 - forget).

    The gate matmul acts on [x_t, h_{t-1}] with one weight, so each step is a single matmul.
    """

    def __init__(self, input_dim: int, hidden_dim: int, projection_dim: int, coupled: bool):
        super().__init__()
        self.coupled = coupled
        self.hidden_dim = hidden_dim
        self.projection_dim = projection_dim
        n_gates = 3 if coupled else 4
        self.gates = nn.Linear(input_dim + projection_dim, n_gates * hidden_dim)
        self.proj = nn.Linear(hidden_dim, projection_dim, bias=False)
        with torch.no_grad():  # forget-gate bias 1: the usual stable start for LSTMs
            self.gates.bias.zero_()
            self.gates.bias[:hidden_dim].fill_(1.0)

    def step(self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One time step: input [b, d], state (h [b, projection], c [b, hidden]) -> new state."""
        z = self.gates(torch.cat([x, h], dim=1))
        if self.coupled:
            f, g, o = z.chunk(3, dim=1)
            f = torch.sigmoid(f)
            c = f * c + (1.0 - f) * torch.tanh(g)
        else:
            f, i, g, o = z.chunk(4, dim=1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return self.proj(torch.sigmoid(o) * torch.tanh(c)), c

    def forward(self, xs: torch.Tensor) -> torch.Tensor:
        batch = xs.shape[0]
        h = xs.new_zeros(batch, self.projection_dim)
        c = xs.new_zeros(batch, self.hidden_dim)
        outs = []
        for x in xs.unbind(1):
            h, c = self.step(x, h, c)
            outs.append(h)
        return torch.stack(outs, dim=1)


class RecurrentLM(nn.Module):
    """Embedding -> (CIF)LSTM layers with projection -> separate output embedding."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.embedding_dim)
        dims = [cfg.embedding_dim] + [cfg.projection_dim] * (cfg.num_layers - 1)
        self.layers = nn.ModuleList(
            RecurrentCell(d, cfg.hidden_dim, cfg.projection_dim, coupled=cfg.arch == "cifg")
            for d in dims
        )
        _add_output(self, cfg.projection_dim, cfg)
        nn.init.normal_(self.embed.weight, std=0.1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return output_logits(self, x)


class DecoderBlock(nn.Module):
    """Pre-norm causal self-attention + MLP, written with explicit matmuls for export."""

    def __init__(self, dim: int, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp_in = nn.Linear(dim, hidden)
        self.mlp_out = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor, causal_bias: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        hd = d // self.heads
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, hd).transpose(1, 2) for z in (q, k, v))
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + causal_bias, dim=-1)
        x = x + self.out((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_out(torch.relu(self.mlp_in(self.norm2(x))))


class TransformerLM(nn.Module):
    """A small causal transformer decoder with learned positions."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.embedding_dim)
        self.pos = nn.Parameter(torch.zeros(cfg.max_length, cfg.embedding_dim))
        self.blocks = nn.ModuleList(
            DecoderBlock(cfg.embedding_dim, cfg.hidden_dim, cfg.num_heads)
            for _ in range(cfg.num_layers)
        )
        self.norm = nn.LayerNorm(cfg.embedding_dim)
        _add_output(self, cfg.embedding_dim, cfg)
        nn.init.normal_(self.embed.weight, std=0.1)
        nn.init.normal_(self.pos, std=0.02)
        mask = torch.full((cfg.max_length, cfg.max_length), float("-inf")).triu(1)
        self.register_buffer("causal_bias", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.embed(tokens) + self.pos[:t]
        bias = self.causal_bias[:t, :t]
        for block in self.blocks:
            x = block(x, bias)
        return output_logits(self, self.norm(x))


def build_model(cfg: ModelConfig) -> nn.Module:
    """Instantiate the zoo model named by `cfg.arch`."""
    if cfg.arch == "transformer":
        return TransformerLM(cfg)
    return RecurrentLM(cfg)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Mean cross-entropy over non-pad targets (the padding mask lives inside the loss)."""
    mask = (targets != pad_id).to(logits.dtype)
    logp = torch.log_softmax(logits, dim=-1)
    nll = -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return (nll * mask).sum() / mask.sum().clamp_min(1.0)
