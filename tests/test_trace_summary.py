"""The per-rank trace summary (nsa_jax/tools/trace_summary.py, launch/trace_summary.py) against hand-timed
synthetic traces, the profile window's config and resume rules (train/trace.py); a real 2-process run's
traces in test_spawn.py."""

from __future__ import annotations

import csv
import gzip
import html.parser
import json
import pathlib

import pytest

from launch import trace_summary as cli
from nsa_jax.config import load_config
from nsa_jax.config_text import ConfigError
from nsa_jax.report import traces as ts
from nsa_jax.train.trace import StepTrace


def _gpu_events():
    """One GPU: compute 0-10 us, an NCCL all-reduce 8-14 (2 of its 6 under compute), a memcpy 14-15, idle 15-20
    up to a last kernel at 20-21: by hand, compute 11, exposed collective 4, exposed copy 1, idle 5."""
    meta = [
        {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0 NVIDIA H200"}},
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
    ]
    k = lambda name, ts_, dur, pid=7, tid=1: {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts_, "dur": dur}
    return meta + [
        k("nsa_selection_fwd", 0.0, 10.0),
        k("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 8.0, 6.0, tid=2),
        k("MemcpyD2D", 14.0, 1.0, tid=3),
        k("nvjet_sm90_tst_128x160", 20.0, 1.0),
        k("host_only_event", 0.0, 500.0, pid=1),  # not a device's: ignored
    ]


def test_a_gpu_trace_splits_into_categories_that_add_up_to_the_window():
    s = ts.summarise(_gpu_events())
    d = s["devices"]["GPU:0"]
    assert d["wall_ms"] == pytest.approx(21e-3)
    want = {"compute": 11e-3, "collective (exposed)": 4e-3, "memory copy (exposed)": 1e-3, "idle": 5e-3}
    assert d["ms"] == pytest.approx(want)
    assert d["collective_overlapped"] == pytest.approx(2 / 6)
    assert [k["name"] for k in s["kernels"]][:2] == ["nsa_selection_fwd", "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"]
    assert {k["name"]: k["category"] for k in s["kernels"]}["MemcpyD2D"] == "memory copy"


def test_a_cpu_trace_reads_thunks_per_device_and_leaves_loops_out():
    thunk = lambda name, dev, ts_, dur: {
        "ph": "X", "pid": 1, "tid": dev, "name": name, "ts": ts_, "dur": dur,
        "args": {"device_ordinal": str(dev), "hlo_op": name},
    }  # fmt: skip
    events = [
        thunk("while.3", 0, 0.0, 100.0),  # holds the two below: not counted twice, not "compute over" the psum
        thunk("ynn_fusion", 0, 0.0, 60.0),
        thunk("psum_invariant.7", 0, 60.0, 40.0),
        thunk("ynn_fusion", 1, 0.0, 90.0),
        thunk("all-reduce.2", 1, 90.0, 10.0),
        {"ph": "X", "pid": 1, "tid": 0, "name": "Rendezvous", "ts": 61.0, "dur": 30.0, "args": {}},
    ]
    s = ts.summarise(events)
    assert set(s["devices"]) == {"CPU:0", "CPU:1"}
    assert s["devices"]["CPU:0"]["ms"] == pytest.approx(
        {"compute": 0.06, "collective (exposed)": 0.04, "memory copy (exposed)": 0.0, "idle": 0.0}
    )
    assert s["devices"]["CPU:1"]["collective_overlapped"] == 0.0
    assert "while.3" not in {k["name"] for k in s["kernels"]}


def _write_trace(folder: pathlib.Path, events) -> None:
    run = folder / "plugins" / "profile" / "2026_12_04_00_00_00"
    run.mkdir(parents=True)
    with gzip.open(run / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)


class _Page(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)


def test_the_command_writes_a_csv_and_a_page_per_rank(tmp_path, capsys):
    for rank in (0, 1):
        _write_trace(tmp_path / "run" / "traces" / f"rank{rank}", _gpu_events())
    assert cli.main([str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "rank 1 GPU:0: window 0.02 ms" in out and "collectives 33% overlapped" in out
    for rank in (0, 1):
        folder = tmp_path / "run" / "trace_summary" / f"rank{rank}"
        rows = list(csv.DictReader(open(folder / "summary.csv")))
        cats = {r["name"]: float(r["ms"]) for r in rows if r["section"] == "category"}
        assert sum(v for k, v in cats.items() if k != "wall") == pytest.approx(cats["wall"], rel=1e-3)
        assert {r["rank"] for r in rows} == {str(rank)}
        page = _Page()
        page.feed((folder / "summary.html").read_text())
        assert {"table", "svg", "rect"} <= set(page.tags) and "script" not in page.tags


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    assert cli.main([str(tmp_path / "missing")]) == 2
    (tmp_path / "run" / "traces" / "rank0").mkdir(parents=True)
    assert cli.main([str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "is not a folder" in err[0]
    assert "no trace under" in err[1] and "perfetto_trace.json.gz" in err[1] and "--profile-steps" in err[1]
    _write_trace(tmp_path / "cpu_only", [{"ph": "X", "pid": 1, "name": "python", "ts": 0.0, "dur": 5.0}])
    assert cli.main([str(tmp_path / "cpu_only")]) == 2
    assert "holds no device ops" in capsys.readouterr().err


@pytest.mark.parametrize(
    "spec,message",
    [("0:2", "outside the run's steps 1..4"), ("3:9", "outside the run's steps 1..4"), ("3:2", "outside"),
     ("two", "must be A:B or A-B")],
)  # fmt: skip
def test_a_profile_window_outside_the_run_is_refused(spec, message):
    with pytest.raises(ConfigError, match=message):
        load_config("cpu_tiny", ["train.steps=4", f"logging.profile_steps={spec}"])
    assert load_config("cpu_tiny", ["train.steps=4", "logging.profile_steps=2-3"]).logging.profile_steps == "2-3"


def test_a_window_stays_text_from_the_flag_an_override_and_a_file(tmp_path):
    # YAML 1.1 reads 10:12 as the base-60 integer 612; the config's loader does not.
    from launch.train import build_parser, flag_overrides

    overrides = flag_overrides(build_parser().parse_args(["--profile-steps", "10:12"]))
    assert load_config("cpu_tiny", ["train.steps=20", *overrides]).logging.profile_steps == "10:12"
    assert load_config("cpu_tiny", ["train.steps=20", "logging.profile_steps=10:12"]).logging.profile_steps == "10:12"
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  steps: 20\n  lr: 1.5e-4\nlogging:\n  profile_steps: 10:12\n")
    cfg = load_config(str(path))
    assert (cfg.logging.profile_steps, cfg.train.steps, cfg.train.lr) == ("10:12", 20, 1.5e-4)


def test_a_resumed_run_traces_what_is_left_of_its_window(tmp_path):
    said = []
    behind = StepTrace("2:3", tmp_path, 0, start_step=5, say=said.append, event=lambda *a, **k: None)
    assert behind.window is None and "are behind this run" in said[-1]
    inside = StepTrace("2:6", tmp_path, 0, start_step=3, say=said.append, event=lambda *a, **k: None)
    assert inside.window == (4, 6) and inside.starts_at(4) and not inside.starts_at(2)
    fresh = StepTrace("2:6", tmp_path, 1, start_step=0, say=said.append, event=lambda *a, **k: None)
    assert fresh.window == (2, 6) and fresh.folder == tmp_path / "traces" / "rank1" and len(said) == 2


def test_a_trace_folder_that_cannot_be_made_costs_the_trace_not_the_run(tmp_path):
    said = []
    (tmp_path / "traces").write_text("a file where the folder should be")
    trace = StepTrace("1:2", tmp_path, 0, start_step=0, say=said.append, event=lambda *a, **k: None)
    trace.start(1)
    assert not trace.active and trace.window is None and "training goes on untraced" in said[-1]
    assert not trace.ends_at(2) and not trace.starts_at(1)
    trace.stop(2)  # nothing to stop: no error
