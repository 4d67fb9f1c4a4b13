"""`dpfleet coordinator ...`: the coordinator as a long-running HTTP service."""

from __future__ import annotations

import click


@click.group(name="coordinator")
def coordinator() -> None:
    """The coordinator service: devices register, check in, train and report over HTTP
    (service/PROTOCOL.md)."""
