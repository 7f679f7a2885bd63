"""train/boot.compile_step: the init thread starts only once the step is lowered (two threads tracing
flax modules at once raced in flax's class machinery), the compile still overlaps the init, a stop
ends the wait, and an error in either thread reaches the caller."""

from __future__ import annotations

import threading
import time

import pytest

from nsa_jax.train.boot import compile_step


class _Step:
    """A stand-in for the jitted step: lower() takes `lower_s`, compile() `compile_s`; both log times."""

    def __init__(self, log, lower_s=0.3, compile_s=0.6, fail=False):
        self.log, self.lower_s, self.compile_s, self.fail = log, lower_s, compile_s, fail

    def lower(self, abstract, batch):
        self.log.append(("lower_start", time.perf_counter()))
        time.sleep(self.lower_s)
        self.log.append(("lower_end", time.perf_counter()))
        if self.fail:
            raise ValueError("bad step")
        return self

    def compile(self):
        time.sleep(self.compile_s)
        self.log.append(("compile_end", time.perf_counter()))
        return "compiled"


def _init(log, seconds=0.3):
    def init():
        log.append(("init_start", time.perf_counter()))
        time.sleep(seconds)
        log.append(("init_end", time.perf_counter()))
        return "state"

    return init


def test_the_init_waits_for_the_lowering_and_overlaps_the_compile():
    log = []
    compiled, seconds, state = compile_step(_Step(log), None, None, _init(log), lambda: False)
    at = dict(log)
    assert (compiled, state) == ("compiled", "state") and seconds >= 0.6
    assert at["init_start"] >= at["lower_end"]  # no trace beside the step's
    assert at["init_start"] < at["compile_end"]  # but the compile still runs beside the init


def test_a_failed_lowering_reaches_the_caller():
    log = []
    with pytest.raises(ValueError, match="bad step"):
        compile_step(_Step(log, fail=True), None, None, _init(log), lambda: False)


def test_a_stop_during_the_lowering_returns_none_without_starting_the_init():
    log, stop = [], threading.Event()
    threading.Timer(0.1, stop.set).start()
    assert compile_step(_Step(log, lower_s=1.0), None, None, _init(log), stop.is_set) is None
    time.sleep(1.2)  # the lowering thread finishes; the init thread has seen the stop
    assert "init_start" not in dict(log)


def test_settings_the_dataset_ignores_are_said():
    import dataclasses

    from nsa_jax.config import load_config
    from nsa_jax.data import unused_data_settings

    data = load_config("cpu_tiny").data
    assert unused_data_settings(data) is None  # synthetic, byte tokenizer, no path
    note = unused_data_settings(dataclasses.replace(data, tokenizer="gpt2"))
    assert note.startswith("data.tokenizer (gpt2) is not used by data.dataset=synthetic") and "fineweb_edu" in note
    both = unused_data_settings(dataclasses.replace(data, dataset="kv_recall", tokenizer="gpt2", path="/data"))
    assert "data.tokenizer (gpt2) and data.path (/data) are not used by data.dataset=kv_recall" in both
    assert unused_data_settings(dataclasses.replace(data, dataset="text", tokenizer="gpt2", path="/d")) is None


def test_zero1_and_fsdp_on_host_devices_of_an_old_jax_are_warned_about():
    """jax 0.10's CPU backend returned wrong gradients for some zero1 / fsdp steps over host devices
    (docs/STUDY.md): boot warns there, and only there."""
    from nsa_jax.train.boot import host_collective_warning

    warned = host_collective_warning("zero1", "cpu", 2, "0.10.2")
    assert warned and "jax 0.10.2's CPU backend" in warned and "use dp, or jax >= 0.12" in warned
    assert host_collective_warning("fsdp", "cpu", 4, "0.11.2")
    for args in [("dp", "cpu", 2, "0.10.2"), ("zero1", "cpu", 1, "0.10.2"), ("zero1", "gpu", 2, "0.10.2")]:
        assert host_collective_warning(*args) is None, args
    assert host_collective_warning("fsdp", "cpu", 2, "0.12.0.1") is None
