"""Training: optimizer, train state, the data-parallel train step, run artifacts, the loop.

  optimizer.py   AdamW, warmup + cosine (or stable-decay) in optimizer steps, decay mask, fp32 master weights
  schedule.py    the selection branch's training schedule: phases (dense selection, distillation), LR on resume
  state.py       TrainState pytree (step, params, opt_state, rng): what a checkpoint saves
  rows.py        the batch record, laid out once (and over `seq` under context parallelism)
  loss.py        the loss of one micro-batch on a device's rows, and its statistics
  strategies.py  where the state lives and how gradients are reduced (parallel.strategy), ShardingPlan
  positions.py   train.rope_positions: the random RoPE positions of a training row
  step.py        the pure jitted step over the (data, seq) mesh: the loss, the strategy's gradient, the update
  boot.py        a run before its first step: mesh, plan, kernel guard, data, restore, first batch; the compile
  loop.py        boot -> compile -> steps: the Trainer
  metrics.py     a finished step's metrics -> training.csv row, TensorBoard scalars, warnings (pure)
  progress.py    what the run says and when: step lines, the progress thread, warnings (no device, no files)
  saves.py       checkpoint saves inside a run; the stop on a failed save or run file
  artifacts.py   training.csv, heartbeat_rank<r>.jsonl, env.json, tb/

This package file imports nothing, so `launch.train` can settle XLA_FLAGS before jax loads.
"""
