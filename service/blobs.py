"""Content-addressed downloads: plans, models and the tokenizer, named by their SHA-256.

Why content addressing: a device checks what it got against the hash in its (signed-channel)
assignment, so a cache, a proxy or a slow mirror can serve blobs without being trusted, and a
blob never changes under a name (`Cache-Control: immutable`). Only blobs of current and recent
plans are kept: old models are dropped once no open round can ask for them. Blobs are served
without credentials, so none may name a device (a hash anyone can compute would answer "is X in
this round?"): plans are shared by a round's devices, per-device fields go in assignments.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

from dpfleet.io import sha256_hex


class BlobStore:
    """In-memory blobs by hash; `pinned` ones (the tokenizer) are never evicted."""

    def __init__(self):
        self._blobs: dict[str, bytes] = {}
        self._pinned: set[str] = set()

    def put(self, data: bytes, pinned: bool = False) -> str:
        sha = sha256_hex(data)
        self._blobs[sha] = bytes(data)
        if pinned:
            self._pinned.add(sha)
        return sha

    def get(self, sha: str) -> bytes | None:
        return self._blobs.get(sha)

    def retain(self, keep: set[str]) -> None:
        """Drop every unpinned blob not in `keep`."""
        for sha in [s for s in self._blobs if s not in keep and s not in self._pinned]:
            del self._blobs[sha]

    def __len__(self) -> int:
        return len(self._blobs)


def folder_tar(folder: Path) -> bytes:
    """A folder as a reproducible tar (sorted names, zero times and owners): one hash per content."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(Path(folder).rglob("*")):
            if not path.is_file():
                continue
            info = tarfile.TarInfo(str(path.relative_to(folder)))
            data = path.read_bytes()
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()
