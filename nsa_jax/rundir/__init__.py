"""The run directory: what a training run writes into its out_dir, and how it is read back.

  files.py         the schema: file names, CSV columns, heartbeat events, exit codes; one CSV writer and reader
  resume.py        the out_dir policy (start, resume, restart, overwrite, refuse) and the checkpoint
                   directory inspection, decided before XLA starts
  lock.py          one trainer per out_dir: an exclusive lock held for the run's lifetime
  checkpoint.py    orbax saves and restores of the whole run (Checkpointer), restore for inference
  checksums.py     one checksum per array and item, recorded at save and verified at restore
  orbax_errors.py  what a failed save says: orbax's background errors as one line

files, resume and lock import no jax. This package file imports nothing.
"""
