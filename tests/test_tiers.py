"""The suite's tiers (tests/conftest.py): what `-m "not slow"`, `--one-case-each` and the release tier
leave to run, read from pytest's own collection of real test files in a subprocess."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import FULL_SUITE_ONLY, RELEASE_ONLY

from helpers import ROOT, cpu_env

# A file with parametrized functions, cases in FULL_SUITE_ONLY and a test marked slow in the file itself.
FILE = "tests/test_block_scores.py"


def pytest_run(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args]
    return subprocess.run(cmd, cwd=ROOT, env=cpu_env(devices=None), capture_output=True, text=True, timeout=300)


def collected(*args: str) -> list[str]:
    r = pytest_run("--collect-only", "-q", *args)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return [line for line in r.stdout.splitlines() if line.startswith("tests/")]


@pytest.mark.slow
def test_the_fast_tier_and_one_case_each_select_what_conftest_says():
    every = collected(FILE)
    fast = collected("-m", "not slow", FILE)
    once = collected("-m", "not slow", "--one-case-each", FILE)
    listed = [n for n in every if n in FULL_SUITE_ONLY]
    assert listed and not set(listed) & set(fast), "FULL_SUITE_ONLY's cases are marked slow before -m deselects"
    assert len(fast) < len(every) - len(listed), "and so is the test the file marks slow"
    firsts = {}
    for nodeid in fast:
        firsts.setdefault(nodeid.split("[")[0], nodeid)
    assert once == list(firsts.values()), "--one-case-each keeps the first of -m's cases of each function"
    assert len(once) < len(fast)


@pytest.mark.slow
def test_a_release_test_is_skipped_saying_so_and_what_the_suite_keeps():
    nodeid = "tests/test_model.py::test_a_chunked_loss_equals_the_loss_of_whole_logits[True]"
    r = pytest_run("-q", "-rs", nodeid)
    assert r.returncode == 0, r.stdout[-2000:]
    assert "1 skipped" in r.stdout
    assert f"release tier (--release runs it); the suite keeps {RELEASE_ONLY[nodeid]}" in r.stdout
