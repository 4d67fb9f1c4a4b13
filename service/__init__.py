"""The coordinator as a network service: devices check in over HTTP (PROTOCOL.md)."""
