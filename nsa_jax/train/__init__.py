"""Training: optimizer, train state, the data-parallel train step, run artifacts, the loop.

  optimizer.py  AdamW, warmup + cosine (or stable-decay) in optimizer steps, decay mask, fp32 master weights
  state.py      TrainState pytree (step, params, opt_state, rng): what a checkpoint saves
  step.py       the pure jitted step over a `data` mesh: accumulation scan, one all-reduce
  artifacts.py  training.csv, heartbeat_rank<r>.jsonl, env.json, tb/
  loop.py       boot -> compile -> steps; the only module with I/O

This package file imports nothing, so `launch.train` can settle XLA_FLAGS before jax loads.
"""
