"""Privacy accounting: zCDP and (eps, delta) conversions, the run's accountant, the planner, and
the privacy report.
"""
