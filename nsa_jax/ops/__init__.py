"""Run operations: multi-process start-up (`distributed`) and in-process health (`health`).

Nothing here is imported by the model or the train step; the loop and the
launchers call in.
"""
