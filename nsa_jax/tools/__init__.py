"""Tools around the model, not part of it: compiling for a GPU that is not there.

  aot.py       target cards, compiles of the train step and the NSA layer for them, their
               memory, and the fit check
  xla_dump.py  the compiled program read back from its XLA dump: launches, loop trip counts,
               Pallas kernel registers and spills, occupancy

Used by launch.info --target, benchmarks/gpu_aot.py, benchmarks/export_report.py and the
tests that lower the Pallas kernels for CUDA.
"""
