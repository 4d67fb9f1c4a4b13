"""The device side: client data, local training behind a runtime interface, the emulated fleet."""
