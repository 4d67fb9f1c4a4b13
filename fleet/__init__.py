"""The device side of the coordinator service: the signed HTTP link and one device's round."""
