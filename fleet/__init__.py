"""The emulated device fleet that talks to the coordinator service over the network."""
