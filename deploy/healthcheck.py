"""The container's health check: is the coordinator of STATE answering?

Why this and not `dpfleet service status --state STATE`: in a container the service listens
on 0.0.0.0 with a certificate for the host's name, which a check from inside cannot verify for
127.0.0.1. This asks the public, read-only status route (`GET /v1/public/status`, no token, no
device ids) over loopback on the port and scheme STATE/admin.json names; exit 0 when it answers
200, else 1. Standard library only: it runs in the image's interpreter before anything else.
"""

from __future__ import annotations

import json
import ssl
import sys
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit


def healthy(state: Path, timeout: float = 5.0) -> bool:
    """Whether the coordinator that wrote STATE/admin.json answers its public status route."""
    try:
        url = urlsplit(json.loads((state / "admin.json").read_text())["url"])
        ctx = None
        if url.scheme == "https":  # our own process on loopback: liveness, not identity
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        probe = f"{url.scheme}://127.0.0.1:{url.port}/v1/public/status"
        with urllib.request.urlopen(probe, timeout=timeout, context=ctx) as answer:
            return answer.status == 200
    except (OSError, ValueError, KeyError, TypeError):
        return False


if __name__ == "__main__":
    sys.exit(0 if healthy(Path(sys.argv[1] if len(sys.argv) > 1 else "/state")) else 1)
