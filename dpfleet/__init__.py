"""dpfleet: private cross-device federated learning of on-device language models.

The stable Python API is `simulate` (and its `Result`); see `dpfleet.api`. Importing the package
stays cheap: torch and the toolkit load on first use of `simulate`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dpfleet.errors import DpfleetError, DpfleetWarning

__version__ = "0.1.0"
__all__ = ["DpfleetError", "DpfleetWarning", "Result", "TokenizerLike", "__version__", "simulate"]

if TYPE_CHECKING:
    from dpfleet.api import Result, TokenizerLike, simulate


def __getattr__(name: str) -> Any:
    """The API's names, imported on first use (`dpfleet.api` imports torch)."""
    if name in ("simulate", "Result", "TokenizerLike"):
        from dpfleet import api

        return getattr(api, name)
    raise AttributeError(f"module 'dpfleet' has no attribute {name!r}")
