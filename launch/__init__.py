"""The commands, each `python -m launch.<name>`.

train, stages, prepare_data, generate, evaluate, info, report, sweep, watchdog, spawn;
cli.py holds their shared flag conventions.
"""
