"""TEST-ONLY stand-in for `coordinator/noise_stream.py:NodeStream` (owned by the noise branch).

Same shape as the contract: `StandInStream(key, tree_id, level, index, domain)` with `.words(n)`
giving uint64 words that continue across calls, here AES-256-CTR from `cryptography` with the
node in the initial counter block. It stands in until the lead merges the real NodeStream;
nothing outside tests imports it.
"""

import hashlib

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes


class StandInStream:
    def __init__(self, key: bytes, tree_id: int, level: int, index: int, domain: bytes = b"dgauss"):
        nonce = (hashlib.sha256(domain).digest()[:4] + tree_id.to_bytes(3, "big")
                 + level.to_bytes(1, "big") + index.to_bytes(4, "big") + bytes(4))
        self._enc = Cipher(algorithms.AES(key), modes.CTR(nonce)).encryptor()

    def words(self, n: int) -> np.ndarray:
        return np.frombuffer(self._enc.update(bytes(8 * n)), dtype="<u8").copy()


def standin_streams(key: bytes):
    """The factory the lead wires as `lambda t, l, i: NodeStream(key, t, l, i, domain=b"dgauss")`."""
    return lambda tree_id, level, index: StandInStream(key, tree_id, level, index)
