"""Tools around the model, not part of it: compiling for a GPU that is not there.

  aot.py  target cards, compiles of the train step and the NSA layer for them, their memory,
          launches, Pallas kernel registers and spills, and the fit check

Used by launch.info --target, benchmarks/gpu_aot.py, benchmarks/export_report.py and the
tests that lower the Pallas kernels for CUDA.
"""
