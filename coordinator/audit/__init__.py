"""Empirical privacy audits: canary runs and estimators.
"""
