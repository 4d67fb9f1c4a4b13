"""The round engine and what it drives: DP-FTRL server step, adaptive clipping, participation,
aggregation, evaluation, trainers, the in-process simulation.
"""
