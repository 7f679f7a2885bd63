"""Training's loop and its shell: a run before its first step, the steps, what the run writes and says.

  boot.py        a run before its first step: mesh, plan, kernel guard, data, restore, first batch; the compile
  loop.py        boot -> compile -> steps: the Trainer
  metrics.py     a finished step's metrics -> training.csv row, TensorBoard scalars, warnings (pure)
  progress.py    what the run says and when: step lines, the progress thread, warnings (no device, no files)
  saves.py       checkpoint saves inside a run; the stop on a failed save or run file
  trace.py       `--profile-steps A:B`: a jax.profiler trace of steps A..B per process
  artifacts.py   training.csv, heartbeat_rank<r>.jsonl, env.json, tb/

The step itself (optimizer, state, rows, loss, strategies, schedule) is nsa_jax/step, a layer below.
This package file imports nothing, so `launch.train` can settle XLA_FLAGS before jax loads.
"""
