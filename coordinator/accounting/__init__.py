"""Privacy accounting: zCDP and (eps, delta) conversions, the planner, and the privacy report's
facts. With the mechanisms, the privacy core: it imports nothing of the config, the engine, the
state or the CLI (the run's accountant and the config-facing parts are `run_privacy`).
"""
