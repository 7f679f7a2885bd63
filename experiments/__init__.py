"""Learning studies: what a model learns under which settings (docs/EXPERIMENTS.md, docs/LONG_CONTEXT.md).

Each module is a command, `python -m experiments.<module> --help`; speed and memory live in benchmarks/.
"""
