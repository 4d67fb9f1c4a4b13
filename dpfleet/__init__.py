"""dpfleet: private cross-device federated learning of on-device language models."""

__version__ = "0.1.0"
