"""Elastic resume: a run checkpointed on one layout resumes on another process or device count
and trains on the same rows, in the same order, in the same optimizer steps as a run that
never stopped.

Every run here has 4 rows per optimizer step (train.global_batch=2 x train.accumulate=2) of
the synthetic stream. A driver records, per optimizer step, a hash of every row each process
put into it; the rows of a step, in micro-batch then process order, are compared with the
uninterrupted one-process run's. Layouts:
  2 processes -> 1   (1 CPU device each; resumed with micro-batch 1 x accumulate 4: the
                      checkpoint ran 1 row per device, so the split is resized)
  1 process  -> 2    (2 x 2 as configured: 1 row per device, within the saved 2)
  2 devices  -> 1    (as 2 processes -> 1)
  1 device   -> 4    (global_batch 2 does not divide over 4 devices: 4 x accumulate 1)
Losses: the sums over rows run in another order on another layout (per device, then
across devices; per micro-batch, then over the accumulation), so they agree to float32
rounding, not bit for bit; the bound below is 1e-4 relative over 6 steps.
"""

from __future__ import annotations

import csv
import json
import pathlib
import subprocess
import sys

import pytest

from nsa_jax.rundir import checkpoint as C
from nsa_jax.rundir import checksums, resume
from nsa_jax.words import count

from helpers import ROOT, TINY_MODEL, cpu_env, set_flags

STEPS, AT = 6, 3

TINY = [
    *TINY_MODEL,
    "model.vocab_size=64",
    "train.seq_len=64",
    "train.global_batch=2",
    "train.accumulate=2",
    "train.log_every=1",
    "train.eval_every=1000",
    "train.warmup=2",
    "checkpoint.save_every=1000",
    "logging.tensorboard=false",
    "logging.aux_stats=false",
    "model.nsa.branches=[cmp]",
]

# launch.train with `_next_batch` wrapped: one JSON line per optimizer step and process,
# the hashes of this process's rows of every micro-batch of the step.
DRIVER = r"""
import hashlib, json, os, sys
import numpy as np
from nsa_jax.mesh import put_batch
from nsa_jax.train import loop

def _next_batch(self):
    import jax
    rec = self.__dict__.setdefault("_rec_step", [int(self.ckpt.last_step or 0)])
    rec[0] += 1
    micro = [self._next_tokens() for _ in range(self.cfg.train.accumulate)]
    hashes = [[hashlib.sha1(np.ascontiguousarray(r).tobytes()).hexdigest()[:16] for r in mb] for mb in micro]
    with open(f"{os.environ['ROWS_LOG']}.{jax.process_index()}", "a") as f:
        f.write(json.dumps({"step": rec[0], "micro": hashes}) + "\n")
    return put_batch(np.stack(micro), self.mesh)

loop.Trainer._next_batch = _next_batch

# STOP_AT: SIGTERM to itself once that step is logged (preemption: a checkpoint, exit 0),
# so the learning-rate schedule is the full run's, as in a real interruption.
stop_at = int(os.environ.get("STOP_AT", "0"))
if stop_at:
    from tests.helpers import sigterm_after_step
    sigterm_after_step(stop_at)
from launch.train import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("elastic")
    (d / "driver.py").write_text(DRIVER)
    return d


def train(
    base: pathlib.Path,
    out: pathlib.Path,
    *,
    procs: int = 1,
    devices: int = 1,
    tag: str,
    stop_at: int = 0,
    sets: tuple[str, ...] = (),
):
    """One launch (under launch.spawn when procs > 1); its row log is `<base>/<tag>.rows.<process>`."""
    cmd = [sys.executable, str(base / "driver.py"), "--config", "cpu_tiny", "--steps", str(STEPS)]
    cmd += ["--out-dir", str(out), *set_flags([*TINY, *sets])]
    if procs > 1:
        cmd = [sys.executable, "-m", "launch.spawn", "--nproc", str(procs), "--grace", "5", "--", *cmd]
    env = cpu_env(devices, base / "cache", ROWS_LOG=str(base / f"{tag}.rows"), STOP_AT=str(stop_at))
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    return r


def step_rows(base: pathlib.Path, tag: str) -> dict[int, list[str]]:
    """{step: the hashes of its rows, micro-batch by micro-batch, process by process}."""
    logs = sorted(base.glob(f"{tag}.rows.*"), key=lambda p: int(p.suffix[1:]))
    per_proc = [{e["step"]: e["micro"] for e in map(json.loads, p.read_text().splitlines())} for p in logs]
    out = {}
    for step in per_proc[0]:
        micro = zip(*(proc[step] for proc in per_proc))  # micro-batch a: every process's part of it
        out[step] = [h for parts in micro for part in parts for h in part]
    return out


def losses(out: pathlib.Path) -> dict[int, float]:
    """{step: loss} at full precision (process 0's heartbeats; a re-run step keeps its last value)."""
    beats = map(json.loads, (out / "heartbeat_rank0.jsonl").read_text().splitlines())
    return {b["step"]: b["loss"] for b in beats if b["event"] == "step_end"}


def uninterrupted(base: pathlib.Path, tag: str, sets: tuple[str, ...] = ()):
    """({step: row hashes}, {step: loss}) of one process training STEPS steps without a stop."""
    out = base / tag
    train(base, out, tag=tag, sets=sets)
    rows = step_rows(base, tag)
    assert sorted(rows) == list(range(1, STEPS + 1)) and all(len(r) == 4 for r in rows.values())
    flat = [h for s in sorted(rows) for h in rows[s]]
    assert len(set(flat)) == len(flat)  # no row twice in the uninterrupted run
    return rows, losses(out)


@pytest.fixture(scope="module")
def reference(base):
    return uninterrupted(base, "straight")


CASES = {
    # name: (first launch (procs, devices), second launch (procs, devices), boot note expected)
    "2proc-1proc": ((2, 1), (1, 1), "train.global_batch 2 -> 1, train.accumulate 2 -> 4"),
    "1proc-2proc": ((1, 1), (2, 1), None),
    "2dev-1dev": ((1, 2), (1, 1), "train.global_batch 2 -> 1, train.accumulate 2 -> 4"),
    "1dev-4dev": ((1, 1), (1, 4), "train.global_batch 2 -> 4, train.accumulate 2 -> 1"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_resume_on_another_layout_trains_on_the_same_rows(base, reference, case):
    resume_on_another_layout(base, reference, case)


def resume_on_another_layout(base, reference, case, sets: tuple[str, ...] = (), tag: str = ""):
    """Stops CASES[case]'s first layout after step AT, resumes on the second, compares with `reference`."""
    ref_rows, ref_loss = reference
    (p1, d1), (p2, d2), note = CASES[case]
    out = base / f"{tag}{case}"
    case = f"{tag}{case}"
    train(base, out, procs=p1, devices=d1, tag=f"{case}-a", stop_at=AT, sets=sets)
    # SIGTERM is acted on at a step boundary every process agrees on: after step AT or a little later.
    (at,) = resume.complete_steps(resume.checkpoint_dir(out))
    assert AT <= at <= AT + 2
    data = json.loads((resume.checkpoint_dir(out) / str(at) / "data" / "metadata").read_text())
    assert data["global"]["train"]["rows"] == at * 4 and data["process_count"] == p1 and "processes" not in data
    r = train(base, out, procs=p2, devices=d2, tag=f"{case}-b", sets=sets)
    boot = next(line for line in r.stdout.splitlines() if "boot:" in line)
    assert f"{count(p2, 'process', 'processes')}, {count(p2 * d2, 'cpu device')}" in boot, boot
    if note:
        assert f"resized on resume: {note}" in boot, boot
    else:
        assert "resized" not in boot, boot
    first = step_rows(base, f"{case}-a")
    rows = {**{s: v for s, v in first.items() if s <= at}, **step_rows(base, f"{case}-b")}
    assert sorted(rows) == list(range(1, STEPS + 1))
    for step in rows:
        assert rows[step] == ref_rows[step], f"step {step}: rows differ from the uninterrupted run"
    got = losses(out)
    assert sorted(got) == list(range(1, STEPS + 1))
    with open(out / "training.csv") as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == list(range(1, STEPS + 1))
    worst = max(abs(got[s] - ref_loss[s]) / abs(ref_loss[s]) for s in got)
    print(f"{case}: stopped after step {at}; same rows in steps 1-{STEPS}; worst relative loss difference {worst:.2e}")
    assert worst < 1e-4


# The prepared-shards dataset (launch.prepare_data): a train split of ~1,500 byte tokens in
# shards of ~200, so 6 steps of 4 rows of 65 tokens (1,560) cross chunks, and the run's rows
# cross an epoch boundary (the stream repeats the split in a new order).
TOKENIZED = ("data.dataset=tokenized", "model.vocab_size=320")


@pytest.fixture(scope="module")
def prepared(base):
    from launch import prepare_data

    docs = base / "docs"
    docs.mkdir()
    words = ["alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega", "x"]
    with open(docs / "corpus.jsonl", "w") as f:
        for i in range(40):
            text = f"doc{i}: " + " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(3 + i % 11))
            f.write(json.dumps({"text": text}) + "\n")
    out = base / "prepared"
    args = ["--input", str(docs), "--output", str(out), "--shard-tokens", "200", "--val-fraction", "0.2"]
    assert prepare_data.main(args) == 0
    return (*TOKENIZED, f"data.path={out}")


@pytest.fixture(scope="module")
def tokenized_reference(base, prepared):
    return uninterrupted(base, "tok-straight", prepared)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["2proc-1proc", "1proc-2proc"])
def test_tokenized_resume_on_another_process_count_trains_on_the_same_rows(base, prepared, tokenized_reference, case):
    resume_on_another_layout(base, tokenized_reference, case, sets=prepared, tag="tok-")


@pytest.mark.slow
def test_a_checkpoint_with_per_process_positions_still_resumes(base, reference):
    # The data item as it was written before global positions (format 1): one state per
    # process that counts its micro-batches. Its checksum is rewritten to match, as then.
    ref_rows, ref_loss = reference
    out = base / "format1"
    train(base, out, tag="format1-a", stop_at=AT)
    (at,) = resume.complete_steps(resume.checkpoint_dir(out))
    step_dir = resume.checkpoint_dir(out) / str(at)
    item = step_dir / "data" / "metadata"
    old = {"kind": "synthetic", "split": "train", "process_index": 0, "position": at * 2}  # accumulate 2
    data = {"format": 1, "process_count": 1, "devices": 1, "processes": [{"train": old, "val": None}]}
    item.write_text(json.dumps(data))
    sums = json.loads((step_dir / "checksums" / "metadata").read_text())
    sums["data"] = checksums.json_checksum(data)
    (step_dir / "checksums" / "metadata").write_text(json.dumps(sums))
    r = train(base, out, tag="format1-b")
    assert f"resume: step {at} from" in r.stdout and "warning" not in r.stdout, r.stdout[-2000:]
    first = step_rows(base, "format1-a")
    rows = {**{s: v for s, v in first.items() if s <= at}, **step_rows(base, "format1-b")}
    assert rows == ref_rows
    got = losses(out)
    assert got == ref_loss  # the same layout: bit for bit


def test_rows_per_step_not_their_split_must_match_on_resume(tmp_path):
    from nsa_jax.config import load_config

    def cfg(*sets):
        return load_config("cpu_tiny", [f"train.out_dir={tmp_path}", *sets])

    saved = cfg("train.global_batch=4", "train.accumulate=2").to_dict()
    blocking, other = resume.resume_conflicts(saved, cfg("train.global_batch=2", "train.accumulate=4"))
    assert blocking == [] and "train.accumulate 2 -> 4" in other
    blocking, _ = resume.resume_conflicts(saved, cfg("train.global_batch=8", "train.accumulate=2"))
    assert blocking == ["train.global_batch x train.accumulate (rows per optimizer step) 8 -> 16"]
    no_data = cfg("train.global_batch=8", "train.accumulate=2", "checkpoint.restore_data=false")
    assert resume.resume_conflicts(saved, no_data)[0] == []


@pytest.mark.parametrize(
    "saved_split,saved_devices,now_split,devices,want",
    [
        ((4, 2), 2, (4, 2), 1, (2, 4)),  # 2 rows per device saved: 4 on one device would not fit
        ((4, 2), 2, (4, 2), 4, None),  # 1 row per device: smaller is fine
        ((2, 4), 1, (4, 2), 2, None),  # the configured split fits the saved 2 rows per device
        ((2, 2), 1, (2, 2), 4, (4, 1)),  # 2 rows do not divide over 4 devices
        ((8, 1), 8, (8, 1), 3, None),  # nothing divides 8 over 3 devices: the batch check reports it
    ],
)
def test_elastic_batch_split(tmp_path, saved_split, saved_devices, now_split, devices, want):
    from nsa_jax.config import load_config

    def cfg(G, A):
        sets = [f"train.out_dir={tmp_path}", f"train.global_batch={G}", f"train.accumulate={A}"]
        return load_config("cpu_tiny", sets)

    step = resume.checkpoint_dir(tmp_path) / "7"
    (step / "config").mkdir(parents=True)
    (step / "data").mkdir()
    (step / "config" / "metadata").write_text(json.dumps(cfg(*saved_split).to_dict()))
    (step / "data" / "metadata").write_text(json.dumps({"format": 2, "devices": saved_devices}))
    now = cfg(*now_split)
    got, note = resume.elastic_batch(now, devices)
    if want is None:
        assert got == now and note is None
    else:
        assert (got.train.global_batch, got.train.accumulate) == want
        assert f"train.accumulate {now_split[1]} -> {want[1]}" in note and "checkpoint step 7" in note
        assert got.train.eval_batches * want[0] == now.train.eval_batches * now_split[0]


@pytest.mark.parametrize("dataset", ["jsonl", "tokenized"])
def test_per_process_position_on_another_process_count_is_refused_with_the_way_out(tmp_path, dataset):
    from types import SimpleNamespace

    from nsa_jax.config import load_config

    cfg = load_config("cpu_tiny", [f"train.out_dir={tmp_path}", f"data.dataset={dataset}"])
    state = {"kind": dataset, "split": "train", "process_count": 2, "iterator": {}}
    data = {"format": 2, "process_count": 2, "devices": 2, "processes": [{"train": state, "val": None}] * 2}
    with pytest.raises(resume.CheckpointError) as e:
        C.Checkpointer._data_for_this_process(SimpleNamespace(cfg=cfg), data, 7)
    msg = str(e.value)
    assert "saved by 2 processes and this run has 1" in msg and "checkpoint.restore_data=false" in msg
    if dataset == "jsonl":  # a file stream: the elastic alternative is named
        assert "python -m launch.prepare_data" in msg and "--dataset tokenized" in msg
    else:  # a tokenized checkpoint from before global positions
        assert "predates global positions" in msg and "prepare_data" not in msg
