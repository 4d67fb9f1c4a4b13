"""What goes to phones: the on-device LM zoo and its exported programs."""
