"""The coordinator's commands (simulate, audit, plan, account): thin, parse, call, print.
"""
