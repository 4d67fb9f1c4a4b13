"""The tiny zoo models both edge-runtime test files compile: one shape and one sequence length,
so the session's program cache (exports take seconds each) serves both files."""

from dpfleet.export.models import ModelConfig

SEQ_LEN = 5


def tiny_config(arch: str) -> ModelConfig:
    return ModelConfig(arch=arch, vocab_size=48, embedding_dim=12, hidden_dim=16, projection_dim=12,
                       num_heads=2, max_length=8)
