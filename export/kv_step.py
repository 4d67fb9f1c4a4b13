"""Streaming keyboard inference for the transformer: a KV-cache step over a bounded window.

`step(token, position, keys, values) -> (logits, keys, values)`: the new token's key and value go
into cache slot `position` of a fixed [layers, batch, heads, slots, head_dim] cache, its query
attends to slots 0..position, and only its next-token logits come back. The cache has `slots` =
seq_len entries, the window program's length, so a message of at most seq_len - 1 tokens (BOS
first, position = number of tokens fed before) gives exactly the window program's last-position
logits (tested); past that the window drops the oldest tokens, and a keyboard re-feeds the last
seq_len - 1 (the bounded window). The slot write is a one-hot blend, not an indexed scatter, so
the ONNX graph has fixed shapes and only elementwise ops for it.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dpfleet.errors import DpfleetError
from dpfleet.export.models import ModelConfig, TransformerLM, output_logits
from dpfleet.export.weight_inputs import export_with_weight_inputs

KV_INPUTS = ("token", "position", "keys", "values")
KV_OUTPUTS = ("logits", "next_keys", "next_values")


def cache_shape(cfg: ModelConfig, slots: int, batch: int = 1) -> tuple[int, ...]:
    return (cfg.num_layers, batch, cfg.num_heads, slots, cfg.embedding_dim // cfg.num_heads)


def empty_cache(cfg: ModelConfig, slots: int, batch: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """The zero caches a message starts from (then feed bos_id at position 0)."""
    shape = cache_shape(cfg, slots, batch)
    return np.zeros(shape, np.float32), np.zeros(shape, np.float32)


class KVCacheStep(nn.Module):
    """token [b] int64, position [] int64 (shared by the batch), keys / values
    [layers, b, heads, slots, head_dim] -> logits [b, V], next keys, next values."""

    def __init__(self, model: TransformerLM, slots: int):
        super().__init__()
        if not isinstance(model, TransformerLM):
            raise DpfleetError("the KV-cache step exists for the transformer only")
        if not 1 <= slots <= model.cfg.max_length:
            raise DpfleetError(f"cache slots must lie in 1..{model.cfg.max_length}")
        self.model = model
        self.slots = slots

    def forward(self, token: torch.Tensor, position: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
        m = self.model
        slot = torch.arange(self.slots, device=token.device)
        here = (slot == position).to(keys.dtype)[:, None]  # [slots, 1]: the slot this token fills
        visible = slot <= position  # [slots]: the causal mask of the newest query
        x = m.embed(token) + (here[:, 0] @ m.pos[: self.slots])  # [b, d]
        b, d = x.shape
        new_k, new_v = [], []
        for i, block in enumerate(m.blocks):
            heads = block.heads
            hd = d // heads
            q, k, v = block.qkv(block.norm1(x)).chunk(3, dim=-1)
            q, k, v = (z.reshape(b, heads, 1, hd) for z in (q, k, v))
            keys_i = keys[i] * (1.0 - here) + k * here  # [b, heads, slots, hd]
            values_i = values[i] * (1.0 - here) + v * here
            scores = (q @ keys_i.transpose(-1, -2)) / math.sqrt(hd)  # [b, heads, 1, slots]
            att = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
            x = x + block.out((att @ values_i).reshape(b, d))
            x = x + block.mlp_out(torch.relu(block.mlp_in(block.norm2(x))))
            new_k.append(keys_i)
            new_v.append(values_i)
        return output_logits(m, m.norm(x)), torch.stack(new_k), torch.stack(new_v)


def kv_step_program(model: TransformerLM, slots: int, path: Path) -> None:
    """Export the step to ONNX (dynamic batch: k candidates at once) with `p.<name>` weight
    inputs, like the window and recurrent step programs of a bundle."""
    keys, values = (torch.from_numpy(c) for c in empty_cache(model.cfg, slots, 2))
    args = (torch.tensor([1, 1]), torch.tensor(0), keys, values)
    batch = torch.export.Dim("batch", min=1, max=4096)
    shapes = ({0: batch}, None, {1: batch}, {1: batch})
    export_with_weight_inputs(KVCacheStep(model, slots).eval(), model, args, list(KV_INPUTS),
                              list(KV_OUTPUTS), shapes, path, prefix="model.")


def kv_streamed_rows(session, cfg: ModelConfig, slots: int, rows: np.ndarray, lengths: np.ndarray,
                     weights: dict) -> np.ndarray:
    """Next-token logits [n, V] after feeding rows[i, :lengths[i]] (BOS first, at most `slots`
    tokens) token by token, all rows as one batch per position (the position is shared)."""
    if lengths.min() < 1 or lengths.max() > slots:
        raise DpfleetError(f"a KV-cache message holds 1..{slots} tokens; re-feed the last {slots - 1}")
    keys, values = empty_cache(cfg, slots, len(rows))
    out = np.zeros((len(rows), cfg.vocab_size), np.float32)
    for position in range(int(lengths.max())):
        logits, keys, values = session.run(None, {"token": rows[:, position].astype(np.int64),
                                                  "position": np.array(position, np.int64),
                                                  "keys": keys, "values": values, **weights})
        done = lengths == position + 1
        out[done] = logits[done]
    return out


def kv_streamed_logits(session, cfg: ModelConfig, slots: int, ids: list[int], weights: dict) -> np.ndarray:
    """Next-token logits [V] after feeding `ids` (BOS first, at most `slots` tokens) one by one."""
    return kv_streamed_rows(session, cfg, slots, np.array([ids], np.int64), np.array([len(ids)]), weights)[0]
