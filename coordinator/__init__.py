"""The server: DP-FTRL rounds, clipping, participation, accounting, run directories."""
