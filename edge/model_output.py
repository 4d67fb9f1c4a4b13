"""What a user's language model returns, read as logits.

Why: `dpfleet.simulate(model=...)` takes any module from int64 ids [batch, time] to logits
[batch, time, vocab], and many real ones return an object instead (a Hugging Face model's
`CausalLMOutput*` carries them as `.logits`). Every place that runs a model's forward for
training, evaluation, auditing or suggestions reads its output through `logits_of`, so such a
model trains as it is, without a wrapper that would rename its parameters in the checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from dpfleet.errors import DpfleetError


def logits_of(output: object) -> torch.Tensor:
    """`output` itself when it is a tensor, else its `.logits` (an attribute or a mapping key)."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, Mapping):
        logits = output.get("logits")
    if isinstance(logits, torch.Tensor):
        return logits
    raise DpfleetError(f"the model returned a {type(output).__name__}: it must return logits [batch, "
                       "time, vocab] as a tensor or as `.logits` (as Hugging Face models do)")
