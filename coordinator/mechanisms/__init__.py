"""DP-FTRL noise mechanisms: strategies (tree, banded, BLT), their sensitivity under the
participation the coordinator enforces, and their secret noise streams (float and ring).
"""
