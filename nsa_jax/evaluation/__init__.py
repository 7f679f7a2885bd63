"""Long-context evaluation: needle retrieval over length x depth, loss by position, kv_recall by distance.

scoring (pure numpy: per-token nll and greedy hits -> the reported figures), suites
(the rows of each suite and how they go through a scorer), scorer (the model's own
forward, compiled per length with its memory checked against the device). The needle
format itself lives in nsa_jax/data/needle.py; the plots in nsa_jax/report/plots.py;
the command line is `python -m launch.evaluate`.
"""
