"""The coordinator as a network service: its device and admin APIs, the operator CLI, the status page."""
