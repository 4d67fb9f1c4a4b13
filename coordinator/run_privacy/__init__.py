"""A run's privacy: the privacy core (accounting, mechanisms) applied to one run's config,
participation and results: the accountant a run keeps, the config's privacy plan, the caveats,
what the guarantee does not cover, the projection and the result warnings.

Why apart from `accounting`: these read the config (`SimulationConfig`), so they sit above it;
the accounting and the mechanisms below the config import nothing of it, the engine or the state
(pyproject.toml's import-linter contract "coordinator").
"""
