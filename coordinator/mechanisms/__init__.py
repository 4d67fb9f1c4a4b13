"""DP-FTRL noise mechanisms, one object each (`base.Mechanism`): strategy and fingerprint,
sensitivity under the participation the coordinator enforces, float and ring noise streams,
resumable state and privacy event. `tree`, `matrix` (banded, BLT) and `independent` implement it and
register themselves (`registry`); the rest is their math and their secret noise streams.
"""
