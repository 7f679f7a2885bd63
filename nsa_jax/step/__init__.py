"""The train step, pure: what one optimizer step computes, and where its arrays live.

  optimizer.py   AdamW, warmup + cosine (or stable-decay) in optimizer steps, decay mask, fp32 master weights
  schedule.py    the selection branch's training schedule: phases (dense selection, distillation), LR on resume
  state.py       TrainState pytree (step, params, opt_state, rng): what a checkpoint saves
  rows.py        the batch record, laid out once (and over `seq` under context parallelism)
  loss.py        the loss of one micro-batch on a device's rows, and its statistics
  strategies.py  where the state lives and how gradients are reduced (parallel.strategy), ShardingPlan
  positions.py   train.rope_positions: the random RoPE positions of a training row
  step.py        the pure jitted step over the (data, seq) mesh: the loss, the strategy's gradient, the update

No files, processes or progress here: the loop that runs the step is nsa_jax/train. This package
file imports nothing, so `launch.train` can settle XLA_FLAGS before jax loads.
"""
