"""launch.prepare_data and the `tokenized` dataset: shards, manifest, splits, sharding, state, bad data."""

from __future__ import annotations

import collections
import io
import json
import pathlib
import re
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from launch import prepare_data
from nsa_jax.config import load_config
from nsa_jax.data import make_dataset, shards, sources, tokenized
from nsa_jax.data.tokenizers import ByteTokenizer

BYTE = ByteTokenizer()
REPO = pathlib.Path(__file__).resolve().parent.parent
WORDS = ["alpha", "beta", "naïve", "日本", "—", "✓", "zeta", "theta", "über", "x"]


def make_docs(n, seed=0, prefix="doc"):
    rng = np.random.default_rng(seed)
    return [f"{prefix}{i}: " + " ".join(rng.choice(WORDS, size=rng.integers(1, 30))) for i in range(n)]


def n_tokens(docs):
    """The byte tokenizer's count: every UTF-8 byte plus one EOS per document."""
    return sum(len(d.encode("utf-8")) + 1 for d in docs)


def write_mixed_corpus(root, docs):
    """A third of the documents as .txt files, a third as jsonl, a third as parquet (row groups of 3)."""
    root.mkdir(parents=True, exist_ok=True)
    txt, jsonl, parquet = docs[0::3], docs[1::3], docs[2::3]
    for i, d in enumerate(txt):
        (root / f"t{i:03d}.txt").write_text(d, encoding="utf-8")
    (root / "sub").mkdir(exist_ok=True)
    with open(root / "sub" / "part.jsonl", "w", encoding="utf-8") as f:
        for d in jsonl:
            f.write(json.dumps({"id": 7, "text": d}) + "\n")
    pq.write_table(pa.table({"text": parquet, "n": list(range(len(parquet)))}), root / "fw.parquet", row_group_size=3)
    return root


def prepare(inp, out, *extra):
    return prepare_data.main(["--input", str(inp), "--output", str(out), *map(str, extra)])


def shard_docs(out, split):
    """Documents stored in a prepared folder's shards of `split`, read back independently of the dataset."""
    m = json.loads((out / "manifest.json").read_text())
    docs = []
    for s in m["shards"]:
        if s["split"] != split:
            continue
        toks = np.load(out / s["tokens_file"])
        ends = np.load(out / s["docs_file"])
        for a, b in zip(np.r_[0, ends[:-1]], ends):
            assert toks[b - 1] == BYTE.eos_id and not (toks[a : b - 1] == BYTE.eos_id).any()
            docs.append(BYTE.decode(toks[a : b - 1]))
    return docs


def split_docs(flat):
    cuts = np.flatnonzero(flat == BYTE.eos_id)
    return [BYTE.decode(flat[a + 1 : b]) for a, b in zip(np.r_[-1, cuts[:-1]], cuts)]


def flat_stream(ds, n):
    parts = [next(ds).reshape(-1)]
    while sum(p.size for p in parts) < n:
        parts.append(next(ds).reshape(-1))
    return np.concatenate(parts)[:n]


def tok_cfg(path, *extra):
    return load_config(
        None,
        [
            "data.dataset=tokenized",
            f"data.path={path}",
            "model.vocab_size=320",
            "train.seq_len=15",
            "train.global_batch=4",
            "data.prefetch=0",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """(docs, prepared folder) of a 90-document mixed corpus, 25% val, shards of ~400 tokens."""
    root = tmp_path_factory.mktemp("corpus")
    docs = make_docs(90, seed=1)
    write_mixed_corpus(root / "in", docs)
    assert prepare(root / "in", root / "out", "--shard-tokens", 400, "--val-fraction", 0.25, "--seed", 3) == 0
    return docs, root / "out"


# ---------------------------------------------------------------------------
# prepare_data


@pytest.mark.slow
def test_cli_end_to_end_counts_and_layout(tmp_path):
    docs = make_docs(60, seed=0)
    write_mixed_corpus(tmp_path / "in", docs)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "launch.prepare_data", "--input", str(tmp_path / "in"), "--output", str(out)]
    cmd += ["--shard-tokens", "300", "--val-fraction", "0.2"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    train = [d for d in docs if sources.in_split(d, "train", 0.2)]
    val = [d for d in docs if sources.in_split(d, "val", 0.2)]
    assert train and val
    first = r.stdout.splitlines()[0]
    assert f"{len(docs):,} documents, {n_tokens(docs):,} tokens" in first and "MB/s" in first
    assert f"train: {len(train):,} documents, {n_tokens(train):,} tokens" in r.stdout
    assert f"val: {len(val):,} documents, {n_tokens(val):,} tokens" in r.stdout
    assert "skipped: 0 files, 0 records" in r.stdout
    assert "prepare_data:" in r.stderr and "MB/s" in r.stderr  # the final progress line

    m = json.loads((out / "manifest.json").read_text())
    assert (m["format"], m["version"], m["dtype"], m["eos_id"]) == (shards.FORMAT, shards.FORMAT_VERSION, "uint16", 256)
    assert m["tokenizer"]["vocab_size"] == 258 and m["tokenizer"]["kind"] == "byte"
    n_train_shards = sum(s["split"] == "train" for s in m["shards"])
    assert m["splits"]["train"] == {"tokens": n_tokens(train), "documents": len(train), "shards": n_train_shards}
    assert sum(s["tokens"] for s in m["shards"]) == n_tokens(docs)
    assert len(m["sources"]) == 20 + 1 + 1 and all(s["bytes"] > 0 for s in m["sources"])
    for s in m["shards"]:
        toks = np.load(out / s["tokens_file"], mmap_mode="r")
        ends = np.load(out / s["docs_file"], mmap_mode="r")
        assert toks.dtype == np.uint16 and toks.shape == (s["tokens"],) and ends.shape == (s["documents"],)
    for split in ("train", "val"):
        entries = [s for s in m["shards"] if s["split"] == split]
        # Every shard but the last closes at the first document end at or past --shard-tokens.
        for s in entries[:-1]:
            ends = np.load(out / s["docs_file"])
            assert ends[-1] >= 300 and (len(ends) == 1 or ends[-2] < 300)
    assert collections.Counter(shard_docs(out, "train")) == collections.Counter(train)
    assert collections.Counter(shard_docs(out, "val")) == collections.Counter(val)
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_progress_bar_on_a_terminal_and_lines_otherwise(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    p = prepare_data.Progress(1000, tty)
    p.update(500, 10, 2000, 3_000_000, force=True)
    drawn = tty.getvalue().split("\r")[-1]
    assert re.match(r"prepare_data:  50%\|#+ +\| 500/1\.00k ", drawn), drawn
    assert "10 docs 2,000 tokens" in drawn and "MB/s" in drawn
    p.close()
    assert tty.getvalue().endswith("\n")
    plain = io.StringIO()
    monkeypatch.setattr(prepare_data, "PROGRESS_EVERY_S", 0.0)
    p = prepare_data.Progress(1000, plain)
    p.update(1000, 3, 30, 100)
    p.close()
    assert re.fullmatch(r"prepare_data: 100\.0% 3 docs 30 tokens [\d.]+ MB/s\n", plain.getvalue())


def test_refuses_non_empty_output_and_overwrite_replaces_only_own_files(tmp_path, capsys):
    docs = make_docs(12, seed=2)
    write_mixed_corpus(tmp_path / "in", docs)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.md").write_text("keep me")
    assert prepare(tmp_path / "in", out) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: --output") and "--overwrite" in err
    assert sorted(p.name for p in out.iterdir()) == ["notes.md"]

    assert prepare(tmp_path / "in", out, "--overwrite", "--shard-tokens", 50) == 0
    manifest = (out / "manifest.json").read_text()
    n_shards = len(json.loads(manifest)["shards"])
    assert n_shards > 2
    capsys.readouterr()
    assert prepare(tmp_path / "in", out, "--shard-tokens", 10_000) == 2  # refused: the earlier output is untouched
    assert "not empty" in capsys.readouterr().err and (out / "manifest.json").read_text() == manifest
    assert prepare(tmp_path / "in", out, "--overwrite", "--shard-tokens", 10_000) == 0
    # The old, smaller shards are gone; the stranger's file stays.
    names = sorted(p.name for p in out.iterdir())
    own = ["manifest.json", "train_00000.docs.npy", "train_00000.tokens.npy", "val_00000.docs.npy"]
    assert names == sorted([*own, "notes.md", "val_00000.tokens.npy"])  # val: the held-out tail (12 documents)
    assert (out / "notes.md").read_text() == "keep me"
    (out / "manifest.json").write_text(json.dumps({"name": "a web app"}))
    assert prepare(tmp_path / "in", out, "--overwrite") == 2
    assert "did not write" in capsys.readouterr().err


def test_interrupted_run_leaves_no_manifest(tmp_path, monkeypatch, capsys):
    docs = make_docs(30, seed=4)
    write_mixed_corpus(tmp_path / "in", docs)
    calls = {"n": 0}
    real = sources.read_chunk

    def interrupted(chunk, on_skip=None):
        calls["n"] += 1
        if calls["n"] == 8:
            raise KeyboardInterrupt
        return real(chunk, on_skip)

    monkeypatch.setattr(sources, "read_chunk", interrupted)
    out = tmp_path / "out"
    assert prepare(tmp_path / "in", out, "--shard-tokens", 40, "--val-fraction", 0) == 130
    assert "no manifest written" in capsys.readouterr().err
    names = [p.name for p in out.iterdir()]
    assert "train_00000.tokens.npy" in names  # complete shards exist, but no manifest claims them
    assert "manifest.json" not in names and not [n for n in names if n.endswith(".tmp")]
    with pytest.raises(ValueError, match="interrupted prepare_data run"):
        make_dataset(tok_cfg(out))
    monkeypatch.setattr(sources, "read_chunk", real)
    assert prepare(tmp_path / "in", out, "--shard-tokens", 40, "--val-fraction", 0) == 2
    assert prepare(tmp_path / "in", out, "--shard-tokens", 40, "--val-fraction", 0, "--overwrite") == 0
    assert collections.Counter(shard_docs(out, "train")) == collections.Counter(docs)


def _text_corpus(root: pathlib.Path, texts: list[str]) -> pathlib.Path:
    root.mkdir(parents=True, exist_ok=True)
    for i, t in enumerate(texts):
        (root / f"book{i}.txt").write_text(t, encoding="utf-8")
    return root


def test_a_corpus_of_few_documents_gets_a_held_out_tail_as_val(tmp_path, capsys):
    # Three .txt files are three documents: the 1% hash split puts none of them in val.
    texts = [" ".join(make_docs(400, seed=s)) for s in range(3)]
    assert not any(sources.in_split(t, "val", 0.01) for t in texts)
    out = tmp_path / "out"
    assert prepare(_text_corpus(tmp_path / "in", texts), out) == 0
    std = capsys.readouterr()
    notes = [line for line in std.err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "none of the 3 documents" in notes[0] and "held out the last" in notes[0], std.err
    m = json.loads((out / "manifest.json").read_text())
    total = n_tokens(texts)
    held = prepare_data.holdout_tokens(total, 0.01)
    assert held == max(-(-total // 100), 4096) and m["val_holdout"]["tokens"] == held
    assert m["splits"]["val"]["tokens"] == held and m["splits"]["train"]["tokens"] == total - held
    assert re.search(rf"^  val: 1 document, {held:,} tokens, 1 shard$", std.out, re.M), std.out
    # Nothing lost or repeated: train then val is the text as written, cut inside its last document.
    train = np.concatenate([np.load(out / s["tokens_file"]) for s in m["shards"] if s["split"] == "train"])
    val = np.concatenate([np.load(out / s["tokens_file"]) for s in m["shards"] if s["split"] == "val"])
    assert sorted(split_docs(np.concatenate([train, val]))) == sorted(texts)
    assert train[-1] != BYTE.eos_id and val[-1] == BYTE.eos_id
    # Both splits read back through the dataset (the manifest's counts hold).
    for split in ("train", "val"):
        rows = next(make_dataset(tok_cfg(out), split))
        assert rows.shape == (4, 16)


def test_too_little_text_for_a_held_out_tail_and_val_fraction_0_say_so(tmp_path, capsys):
    out = tmp_path / "out"
    assert prepare(_text_corpus(tmp_path / "in", ["ab"]), out) == 0  # 3 tokens: nothing to spare
    err = capsys.readouterr().err
    assert "warning: none of the 1 document fell" in err and "too few to hold any out" in err, err
    assert "val_holdout" not in json.loads((out / "manifest.json").read_text())
    assert prepare(_text_corpus(tmp_path / "in2", ["abc " * 100]), tmp_path / "out2", "--val-fraction", 0) == 0
    std = capsys.readouterr()
    assert "val: none (--val-fraction 0)" in std.out and "note:" not in std.err


def test_output_inside_input_is_not_read_back(tmp_path):
    docs = make_docs(9, seed=5)
    write_mixed_corpus(tmp_path / "in", docs)
    out = tmp_path / "in" / "prepared"
    # --val-fraction 0: whole documents only (nine are too few for the hash split: a held-out tail would cut one)
    assert prepare(tmp_path / "in", out, "--val-fraction", "0") == 0
    assert prepare(tmp_path / "in", out, "--overwrite", "--val-fraction", "0") == 0  # manifest.json is no .json input
    assert collections.Counter(shard_docs(out, "train") + shard_docs(out, "val")) == collections.Counter(docs)


# ---------------------------------------------------------------------------
# the tokenized dataset


def test_processes_read_one_global_stream_that_covers_every_train_token_once_per_epoch(prepared, monkeypatch):
    docs, out = prepared
    monkeypatch.setattr(tokenized, "CHUNK_TOKENS", 64)  # many chunks of a few documents
    train = [d for d in docs if sources.in_split(d, "train", 0.25)]
    all_tokens = np.concatenate(
        [
            np.load(out / s["tokens_file"])
            for s in json.loads((out / "manifest.json").read_text())["shards"]
            if s["split"] == "train"
        ]
    )
    P, L = 2, 16
    procs = [make_dataset(tok_cfg(out), process_index=p, process_count=P) for p in range(P)]
    E = procs[0].epoch_tokens
    assert procs[0].n_chunks > 8 and E == len(all_tokens)
    # Micro-batch m is global rows [4m, 4m + 4): process p reads rows 4m + 2p, 4m + 2p + 1.
    # Two epochs and a row, every process's rows in micro-batch then process order:
    n_micro = 2 * E // (4 * L) + 1
    parts = []
    for _ in range(n_micro):
        for ds in procs:
            b = next(ds)
            assert b.shape == (2, L) and b.dtype == np.int32
            parts.append(b.reshape(-1))
    flat = np.concatenate(parts)
    # The one-process stream is the same rows: the rows of a step do not depend on the layout.
    np.testing.assert_array_equal(flat_stream(make_dataset(tok_cfg(out)), len(flat)), flat)
    # One epoch = the first epoch_tokens tokens: every train token once, every document once;
    # the tail that does not fill a row continues into the next epoch, in a new order.
    epoch, second = flat[:E], flat[E : 2 * E]
    np.testing.assert_array_equal(np.sort(epoch), np.sort(all_tokens))
    assert epoch[-1] == BYTE.eos_id
    assert collections.Counter(split_docs(epoch)) == collections.Counter(train)
    assert collections.Counter(split_docs(second)) == collections.Counter(train)
    assert split_docs(second) != split_docs(epoch)
    # The state is the global row count, the same on every process.
    states = [ds.get_state() for ds in procs]
    assert states[0] == states[1] and states[0]["rows"] == 4 * n_micro


def test_deterministic_and_seeded(prepared):
    _, out = prepared
    a, b, other = (make_dataset(tok_cfg(out, *extra)) for extra in ((), (), ("train.seed=99",)))
    first = [next(a) for _ in range(6)]
    for x in first:
        np.testing.assert_array_equal(next(b), x)
    assert not all(np.array_equal(next(other), x) for x in first)


def test_val_split_is_disjoint_from_train(prepared):
    docs, out = prepared
    val = [d for d in docs if sources.in_split(d, "val", 0.25)]
    ds = make_dataset(tok_cfg(out, "data.val_fraction=0.0"), "val")  # the manifest's split, not data.val_fraction
    got = split_docs(flat_stream(ds, n_tokens(val)))
    assert collections.Counter(got) == collections.Counter(val)
    assert not set(got) & set(shard_docs(out, "train"))


def test_state_round_trip_mid_epoch_and_on_another_process_count(prepared, monkeypatch):
    _, out = prepared
    monkeypatch.setattr(tokenized, "CHUNK_TOKENS", 64)
    cfg = tok_cfg(out)
    a = make_dataset(cfg)
    for _ in range(5):
        next(a)
    state = json.loads(json.dumps(a.get_state()))
    assert set(state) == {"kind", "split", "rows", "block_rows", "chunks"}
    assert state["kind"] == "tokenized" and state["rows"] == 20
    expected = [next(a) for _ in range(40)]  # crosses chunk and epoch boundaries
    b = make_dataset(cfg)
    next(b)
    b.set_state(state)
    for x in expected:
        np.testing.assert_array_equal(next(b), x)
    # Saved by one process, resumed by two: each reads its half of the same rows.
    halves = [make_dataset(cfg, process_index=p, process_count=2) for p in range(2)]
    for h in halves:
        h.set_state(state)
    for x in expected[:10]:
        np.testing.assert_array_equal(np.concatenate([next(h) for h in halves]), x)
    with pytest.raises(ValueError, match="rows per optimizer step"):
        make_dataset(tok_cfg(out, "train.global_batch=8")).set_state(state)
    with pytest.raises(ValueError, match="different corpus"):
        make_dataset(cfg).set_state({**state, "chunks": "0" * 16})


@pytest.mark.parametrize("workers,prefetch", [(0, 0), (2, 2)])
def test_per_process_state_from_before_global_positions_resumes(prepared, monkeypatch, workers, prefetch):
    # A checkpoint written before global positions holds the grain state of each process's own
    # stream; it resumes that stream exactly, with its process count, and keeps it.
    _, out = prepared
    monkeypatch.setattr(tokenized, "CHUNK_TOKENS", 64)
    cfg = tok_cfg(out, f"data.workers={workers}", f"data.prefetch={prefetch}")
    old = tokenized.PerProcessTokenized(make_dataset(cfg, process_index=1, process_count=2))
    for _ in range(5):
        next(old)
    state = json.loads(json.dumps(old.get_state()))
    assert state["process_index"] == 1 and state["process_count"] == 2 and "iterator" in state
    expected = [next(old) for _ in range(40)]
    ds = make_dataset(cfg, process_index=1, process_count=2)
    ds.set_state(state)
    for x in expected[:20]:
        np.testing.assert_array_equal(next(ds), x)
    again = json.loads(json.dumps(ds.get_state()))
    assert "iterator" in again and "rows" not in again  # saved per process again
    fresh = make_dataset(cfg, process_index=1, process_count=2)
    fresh.set_state(again)
    for x in expected[20:]:
        np.testing.assert_array_equal(next(fresh), x)
    with pytest.raises(ValueError, match="process_index"):
        make_dataset(cfg, process_index=0, process_count=2).set_state(state)
    with pytest.raises(ValueError, match="number of processes"):
        make_dataset(tok_cfg(out, "train.global_batch=2")).set_state({**state, "process_index": 0})
    for s in (old, ds, fresh):
        s.close()


def test_tokenized_checks_vocab_tokenizer_version_and_shards(prepared, tmp_path):
    _, out = prepared
    with pytest.raises(ValueError, match=r"model.vocab_size \(256\).*258.*set model.vocab_size=320"):
        make_dataset(tok_cfg(out, "model.vocab_size=256"))
    (tmp_path / "tok.json").write_text("{}")
    with pytest.raises(ValueError, match="prepared with tokenizer 'byte'.*pass --tokenizer byte"):
        make_dataset(tok_cfg(out, f"data.tokenizer={tmp_path / 'tok.json'}"))
    copy = tmp_path / "copy"
    copy.mkdir()
    for p in out.iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    m = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**m, "version": 99}))
    with pytest.raises(ValueError, match="format version 99.*reads version 1"):
        make_dataset(tok_cfg(copy))
    (copy / "manifest.json").write_text(json.dumps(m))
    first = m["shards"][0]["tokens_file"]
    data = (copy / first).read_bytes()
    (copy / first).write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=f"{first}.*truncated"):
        make_dataset(tok_cfg(copy))
    with pytest.raises(ValueError, match="no manifest.json, so it is not a prepared folder"):
        make_dataset(tok_cfg(tmp_path))
    with pytest.raises(ValueError, match="use data.dataset=tokenized"):
        make_dataset(load_config(None, ["data.dataset=jsonl", f"data.path={out}", "model.vocab_size=320"]))
    no_val = tmp_path / "no_val"
    assert prepare(copy, no_val) == 2  # already prepared: not an input
    write_mixed_corpus(tmp_path / "in", make_docs(6))
    assert prepare(tmp_path / "in", no_val, "--val-fraction", 0) == 0
    with pytest.raises(ValueError, match="no val shards.*--val-fraction > 0"):
        make_dataset(tok_cfg(no_val), "val")


def test_tokenizer_json_identity(tmp_path):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(make_docs(40), trainer=trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    write_mixed_corpus(tmp_path / "in", make_docs(12))
    assert prepare(tmp_path / "in", tmp_path / "out", "--tokenizer", tmp_path / "tokenizer.json") == 0
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["tokenizer"]["kind"] == "json" and len(m["tokenizer"]["sha256"]) == 64
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    (moved / "tokenizer.json").write_bytes((tmp_path / "tokenizer.json").read_bytes())
    ds = make_dataset(tok_cfg(tmp_path / "out", f"data.tokenizer={moved}"))  # same file content, other path
    assert next(ds).max() < m["tokenizer"]["vocab_size"]


# ---------------------------------------------------------------------------
# bad data


def write_bad_corpus(root):
    """Good documents among every kind of bad data; returns the good documents."""
    root.mkdir(parents=True)
    good = make_docs(8, seed=7)
    (root / "good.txt").write_text(good[0], encoding="utf-8")
    for name in ("empty.txt", "empty.jsonl", "empty.parquet"):
        (root / name).write_bytes(b"")
    (root / "corrupt.parquet").write_bytes(b"not a parquet file " * 20)
    pq.write_table(pa.table({"content": ["x"]}), root / "notext.parquet")
    (root / "latin1.txt").write_bytes("café au lait".encode("latin-1"))
    (root / "content.jsonl").write_text(json.dumps({"content": "no text key"}) + "\n")
    lines = [
        json.dumps({"text": good[1]}).encode(),
        b'{"text": "truncated',
        b'{"text": "caf\xe9"}',
        json.dumps({"content": "x"}).encode(),
        b'{"text": "\\ud800 lone"}',
        json.dumps({"text": good[2]}).encode(),
    ]
    (root / "lines.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    binary = pa.array([good[3].encode(), b"\xff\xfe bad", good[4].encode()], pa.binary())
    pq.write_table(pa.table({"text": binary}), root / "binary.parquet")
    pq.write_table(pa.table({"text": good[5:]}), root / "fine.parquet")
    return good


def test_bad_data_is_skipped_counted_and_listed(tmp_path, capsys):
    good = write_bad_corpus(tmp_path / "in")
    out = tmp_path / "out"
    assert prepare(tmp_path / "in", out, "--val-fraction", 0) == 0
    summary = capsys.readouterr().out
    m = json.loads((out / "manifest.json").read_text())
    files = {pathlib.Path(s["path"]).name: s["reason"] for s in m["skipped"]["files"]}
    assert files == {
        "empty.txt": "empty file",
        "empty.jsonl": "empty file",
        "empty.parquet": "empty file",
        "corrupt.parquet": "corrupt file",
        "notext.parquet": "no 'text' field",
        "content.jsonl": "no 'text' field",
    }
    assert m["skipped"]["records"] == {"invalid JSON": 1, "no 'text' field": 1, "not UTF-8": 4}
    places = {(pathlib.Path(s["path"]).name, s["reason"], s["where"]) for s in m["skipped"]["record_examples"]}
    second_line_at = len(json.dumps({"text": good[1]}).encode()) + 1
    assert ("lines.jsonl", "invalid JSON", f"byte {second_line_at}") in places
    assert ("binary.parquet", "not UTF-8", "row 1 of row group 0") in places
    assert ("latin1.txt", "not UTF-8", "") in places
    assert "skipped: 6 files, 6 records" in summary
    assert "empty file: 3 files" in summary and "corrupt.parquet" in summary and "not UTF-8: 4 records" in summary
    assert f"{len(good)} documents, {n_tokens(good)} tokens" in summary
    assert collections.Counter(shard_docs(out, "train")) == collections.Counter(good)

    assert prepare(tmp_path / "in", tmp_path / "strict", "--strict") == 2
    err = capsys.readouterr().err.strip()
    # Files are indexed in name order: content.jsonl is the first bad one.
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "content.jsonl" in err
    assert not (tmp_path / "strict" / "manifest.json").exists()


def test_a_failed_run_leaves_no_empty_output_folder_behind(tmp_path, capsys):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "b.txt").write_bytes(b"")
    # The folders it made (--output and the parents it needed) go again; a folder that was there stays.
    assert prepare(tmp_path / "bad", tmp_path / "new" / "deeper" / "out") == 2
    assert "no documents found" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    (tmp_path / "mine").mkdir()
    assert prepare(tmp_path / "bad", tmp_path / "mine") == 2
    assert (tmp_path / "mine").is_dir() and not list((tmp_path / "mine").iterdir())


def test_inputs_without_documents_are_errors(tmp_path, capsys):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.md").write_text("x")
    assert prepare(tmp_path / "notes", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "has no *.parquet/*.jsonl/*.json/*.txt files (it holds 1 .md file)" in err
    assert prepare(tmp_path / "nowhere", tmp_path / "out") == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "a.jsonl").write_bytes(b"{oops\n")
    (tmp_path / "bad" / "b.txt").write_bytes(b"")
    assert prepare(tmp_path / "bad", tmp_path / "out2") == 2
    err = capsys.readouterr().err
    assert "no documents found" in err and "invalid JSON" in err and "empty file" in err
    assert not (tmp_path / "out2" / "manifest.json").exists()
