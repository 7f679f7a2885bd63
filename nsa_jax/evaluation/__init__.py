"""Evaluation: the held-out metrics of a training run, and the long-context suites.

heldout (the fixed validation rows of a run and their loss, perplexity and retrieval
accuracy, at every train.eval_every), scoring (pure numpy: per-token nll and greedy
hits -> the reported figures), suites (needle retrieval over length x depth, loss by
position, kv_recall by distance: the rows of each suite and how they go through a
scorer), scorer (the model's own forward, compiled per length with its memory checked
against the device), training (what a training run evaluates: `RunEvaluation`, built
once by the Trainer; eval.suites through `TrainingSuites`), results (launch.evaluate's
evaluation.json, written after each (suite, L) and read back to continue), timing (the
cost model of a row and the projected time of an evaluation). The needle format itself
lives in nsa_jax/data/needle.py; the plots in nsa_jax/report/plots.py; the command
line for a checkpoint is `python -m launch.evaluate`.
"""
