"""What must survive: the run directory, the release log, resume points, the service's SQLite state
store.
"""
