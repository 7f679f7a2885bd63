"""Data checked before a run touches its out dir (nsa_jax/data/check.py): empty, binary and small corpora."""

from __future__ import annotations

import pathlib

import pytest

from launch import prepare_data
from nsa_jax.config import load_config
from nsa_jax.data import make_dataset, sources
from nsa_jax.data.check import DataCheck, check_data, repeat_note

from helpers import cpu_env, run_module

ROOT = pathlib.Path(__file__).resolve().parent.parent


def text_cfg(path: pathlib.Path, *sets: str):
    return load_config("cpu_tiny", ["data.dataset=text", f"data.path={path}", "model.vocab_size=320", *sets])


def books(root: pathlib.Path, n: int, words: int = 3000) -> pathlib.Path:
    """`n` .txt files (one document each) whose text hashes into train at data.val_fraction 0.01."""
    root.mkdir(parents=True, exist_ok=True)
    i = 0
    while len(list(root.iterdir())) < n:
        text = f"book {i}: " + " ".join(f"w{(i * 7 + k) % 97}" for k in range(words))
        i += 1
        if not sources.in_split(text, "val", 0.01):
            (root / f"book{i}.txt").write_text(text)
    return root


def test_an_empty_file_is_named_as_empty(tmp_path):
    (tmp_path / "a.txt").write_text("")
    with pytest.raises(ValueError) as e:
        check_data(text_cfg(tmp_path))
    msg = str(e.value)
    assert f"its only file {tmp_path / 'a.txt'} is empty (0 bytes)" in msg and "processes" not in msg
    (tmp_path / "b.txt").write_text("")
    with pytest.raises(ValueError, match="its 2 files are all empty"):
        check_data(text_cfg(tmp_path))
    # The stream says the same when it is opened without the check (a Trainer built in Python).
    with pytest.raises(ValueError, match="are all empty") as e:
        make_dataset(text_cfg(tmp_path))
    assert "processes" not in str(e.value)


def test_a_binary_file_is_one_line_naming_it_and_the_fix(tmp_path, caplog):
    (tmp_path / "data.txt").write_bytes(bytes(range(128, 256)) * 40)
    with pytest.raises(ValueError) as e:
        check_data(text_cfg(tmp_path))
    msg = str(e.value)
    assert "holds no usable text" in msg and str(tmp_path / "data.txt") in msg and "not UTF-8" in msg
    assert "UTF-8 (e.g. iconv" in msg and "val_fraction" not in msg and "\n" not in msg
    assert not caplog.records  # no warning per read before the error


def test_a_small_corpus_has_no_validation_split_and_says_how_to_get_one(tmp_path):
    found = check_data(text_cfg(books(tmp_path / "in", 3)))
    assert found.no_val is not None and "none of the 3 documents" in found.no_val
    assert "launch.prepare_data" in found.no_val and "--dataset tokenized" in found.no_val
    assert "0 is" not in found.no_val
    off = check_data(text_cfg(tmp_path / "in", "data.val_fraction=0"))
    assert "data.val_fraction is 0" in off.no_val
    # Enough documents: some fall in the validation split.
    many = tmp_path / "many"
    many.mkdir()
    for i in range(300):
        (many / f"d{i}.txt").write_text(f"document {i}")
    assert check_data(text_cfg(many)).no_val is None


def test_a_prepared_folder_without_val_shards_trains_without_evaluation(tmp_path):
    inp = books(tmp_path / "in", 2)
    out = tmp_path / "prepared"
    assert prepare_data.main(["--input", str(inp), "--output", str(out), "--val-fraction", "0"]) == 0
    cfg = load_config("cpu_tiny", ["data.dataset=tokenized", f"data.path={out}", "model.vocab_size=320"])
    found = check_data(cfg)
    assert "has no validation split (prepared with --val-fraction 0" in found.no_val
    # prepare_data's held-out tail (the default --val-fraction) gives one.
    again = tmp_path / "prepared2"
    assert prepare_data.main(["--input", str(inp), "--output", str(again)]) == 0
    cfg = load_config("cpu_tiny", ["data.dataset=tokenized", f"data.path={again}", "model.vocab_size=320"])
    assert check_data(cfg).no_val is None
    # A model vocabulary the prepared tokenizer does not fit: refused here, before any out dir.
    small = load_config("cpu_tiny", ["data.dataset=tokenized", f"data.path={again}", "model.vocab_size=128"])
    with pytest.raises(ValueError, match=r"model.vocab_size \(128\) is smaller .* set model.vocab_size=320"):
        check_data(small)


def test_a_corpus_the_run_reads_many_times_gets_a_note_saying_how_many(tmp_path):
    # 3 books, byte tokenizer: their bytes and one EOS each, packed into rows of 257 tokens.
    inp = books(tmp_path / "in", 3)
    tokens = sum(len(f.read_bytes()) + 1 for f in inp.iterdir())
    rows = tokens // 257
    cfg = text_cfg(inp, "data.val_fraction=0", "train.steps=200")  # 200 steps x 8 rows
    found = check_data(cfg)
    assert found.train_rows == rows
    assert repeat_note(cfg, found) == (
        f"note: the training data is {rows} rows of 257 tokens: 200 steps x 8 rows read it {1600 / rows:.0f} times"
    )
    # Read less than twice: no note; data too large to count cheaply: not counted.
    assert repeat_note(text_cfg(inp, "data.val_fraction=0", f"train.steps={rows // 8}"), found) is None
    assert repeat_note(cfg, DataCheck()) is None
    # A prepared folder: the manifest's train tokens.
    out = tmp_path / "prepared"
    assert prepare_data.main(["--input", str(inp), "--output", str(out), "--val-fraction", "0"]) == 0
    prepared = load_config(
        "cpu_tiny", ["data.dataset=tokenized", f"data.path={out}", "model.vocab_size=320", "train.steps=200"]
    )
    assert check_data(prepared).train_rows == rows
    assert "read it" in repeat_note(prepared, check_data(prepared))


@pytest.mark.parametrize("what", ["empty", "binary"])
def test_the_launcher_reports_bad_data_in_one_line_before_touching_the_out_dir(tmp_path, what):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_bytes(b"" if what == "empty" else b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8)
    out = tmp_path / "run"
    r = run_module(
        "launch.train",
        *("--config", "cpu_tiny", "--dataset", "text", "--data-path", str(data), "--out-dir", str(out)),
        env=cpu_env(1),
        timeout=120,
    )
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: data.path {data} holds no"), r.stderr
    assert ("is empty (0 bytes)" if what == "empty" else "not UTF-8") in lines[0]
    assert not out.exists()
