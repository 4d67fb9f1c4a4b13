"""Secure aggregation: sans-I/O pairwise-mask protocol, crypto, encoding."""
