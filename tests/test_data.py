"""Data layer: synthetic and kv_recall streams, tokenizers, file sources, grain packing and state."""

from __future__ import annotations

import collections
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from nsa_jax.config import load_config
from nsa_jax.data import first_batch_with_timeout, kv_recall, make_dataset, make_tokenizer, padded_vocab_size, sources
from nsa_jax.data.tokenizers import ByteTokenizer

BYTE = ByteTokenizer()


def cfg_with(*overrides):
    return load_config(None, list(overrides))


def take(ds, n):
    return [next(ds) for _ in range(n)]


# ---------------------------------------------------------------------------
# synthetic


def test_synthetic_shapes_range_and_json_state():
    cfg = cfg_with("train.seq_len=64", "train.global_batch=6", "model.vocab_size=100")
    ds = make_dataset(cfg, process_index=1, process_count=3)
    tokens_BxT1 = next(ds)
    assert tokens_BxT1.shape == (2, 65) and tokens_BxT1.dtype == np.int32
    assert tokens_BxT1.min() >= 0 and tokens_BxT1.max() < 100
    state = json.loads(json.dumps(ds.get_state()))
    assert state["rows"] == 6  # global: the whole micro-batch of 6 rows was consumed, 2 of them here


def test_synthetic_deterministic_random_access_and_resume():
    cfg = cfg_with("train.seq_len=32", "train.global_batch=4")
    a, b = make_dataset(cfg), make_dataset(cfg)
    batches = take(a, 5)
    for i, x in enumerate(take(b, 5)):
        np.testing.assert_array_equal(x, batches[i])
    # Random access: the batch at position i does not depend on what was read before.
    np.testing.assert_array_equal(make_dataset(cfg).batch_at(3), batches[3])
    c = make_dataset(cfg)
    c.set_state(json.loads(json.dumps({**a.get_state(), "rows": 2 * 4})))
    np.testing.assert_array_equal(next(c), batches[2])
    # A state of the per-process layout (micro-batches of one process) still restores.
    d = make_dataset(cfg)
    d.set_state({"kind": "synthetic", "split": "train", "process_index": 0, "position": 3})
    np.testing.assert_array_equal(next(d), batches[3])
    # A different seed, process or split gives different data.
    other_seed = make_dataset(cfg_with("train.seq_len=32", "train.global_batch=4", "train.seed=7"))
    assert not np.array_equal(next(other_seed), batches[0])
    p1 = make_dataset(cfg_with("train.seq_len=32", "train.global_batch=8"), process_index=1, process_count=2)
    assert not np.array_equal(next(p1), batches[0])
    assert not np.array_equal(next(make_dataset(cfg, split="val")), batches[0])


@pytest.mark.parametrize("kind", ["synthetic", "kv_recall"])
def test_rows_of_a_step_do_not_depend_on_processes_or_micro_batches(kind):
    # 8 rows per optimizer step, read as 1 x 8, 2 x 4 or 4 x 2 micro-batches by 1, 2 or 4
    # processes, and restored mid-stream from another layout's state: the same rows in order.
    extra = ["data.dataset=kv_recall", "model.vocab_size=64", "model.nsa.w=8"] if kind == "kv_recall" else []

    def step_rows(G, A, P, steps, state=None):
        cfg = cfg_with("train.seq_len=64", f"train.global_batch={G}", f"train.accumulate={A}", *extra)
        streams = [make_dataset(cfg, process_index=p, process_count=P) for p in range(P)]
        for ds in streams:
            if state is not None:
                ds.set_state(json.loads(json.dumps(state)))
        out = [np.concatenate([np.concatenate([next(ds) for ds in streams]) for _ in range(A)]) for _ in range(steps)]
        states = {json.dumps(ds.get_state(), sort_keys=True) for ds in streams}
        assert len(states) == 1  # one global state, the same on every process
        return out, json.loads(states.pop())

    ref, _ = step_rows(8, 1, 1, 4)
    assert not np.array_equal(ref[0], ref[1])
    for G, A, P in [(8, 1, 2), (4, 2, 2), (2, 4, 1), (4, 2, 4)]:
        first, state = step_rows(G, A, P, 2)
        assert state["rows"] == 16
        for G2, A2, P2 in [(8, 1, 1), (2, 4, 2)]:
            rest, _ = step_rows(G2, A2, P2, 2, state)
            for got, want in zip(first + rest, ref):
                np.testing.assert_array_equal(got, want)
    cfg = cfg_with("train.seq_len=64", "train.global_batch=8", "train.accumulate=2", *extra)
    with pytest.raises(ValueError, match="rows per optimizer step"):
        make_dataset(cfg).set_state(state)


def test_synthetic_is_learnable():
    V = 256
    cfg = cfg_with("train.seq_len=256", "train.global_batch=8", f"model.vocab_size={V}")
    ds = make_dataset(cfg)
    x = np.concatenate(take(ds, 40))
    counts_VxV = np.zeros((V, V))
    np.add.at(counts_VxV, (x[:, :-1].ravel(), x[:, 1:].ravel()), 1)
    p = counts_VxV / counts_VxV.sum(1, keepdims=True).clip(1)
    cond_entropy = -(counts_VxV * np.log(np.where(p > 0, p, 1))).sum() / counts_VxV.sum()
    unigram = np.bincount(x.ravel(), minlength=V) / x.size
    assert cond_entropy < 0.5 * math.log(V)
    # Not degenerate: many tokens occur and the marginal is not concentrated.
    assert (unigram > 0).sum() > V * 0.9


def test_synthetic_is_fast():
    cfg = cfg_with("train.seq_len=256", "train.global_batch=8")
    ds = make_dataset(cfg)
    ds.batch_at(0)
    times = []
    for i in range(7):
        t = time.perf_counter()
        ds.batch_at(i)
        times.append(time.perf_counter() - t)
    assert min(times) < 0.010, times


def test_bad_batch_split_and_state_mismatch():
    cfg = cfg_with("train.global_batch=6")
    with pytest.raises(ValueError, match="train.global_batch"):
        make_dataset(cfg, process_count=4)
    with pytest.raises(ValueError, match="split"):
        make_dataset(cfg, split="test")
    ds = make_dataset(cfg)
    with pytest.raises(ValueError, match="kind"):
        ds.set_state({"kind": "jsonl", "split": "train", "process_index": 0, "position": 0})
    with pytest.raises(ValueError, match="split"):
        ds.set_state({**ds.get_state(), "split": "val"})


# ---------------------------------------------------------------------------
# tokenizers


def test_byte_tokenizer_round_trip():
    tok = make_tokenizer(cfg_with().data)
    text = "héllo, wörld — ✓ 日本"
    ids = tok.encode(text)
    assert max(ids) < 256 and tok.decode(ids) == text
    assert (tok.vocab_size, tok.eos_id, tok.pad_id) == (258, 256, 257)
    assert tok.decode(ids + [tok.eos_id, tok.pad_id]) == text
    np.testing.assert_array_equal(tok.encode_np(text), ids)
    assert padded_vocab_size(258) == 320 and padded_vocab_size(256) == 256 and padded_vocab_size(1, 8) == 8


def _train_bpe(path, with_eos=True):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"] if with_eos else [],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 40, trainer=trainer)
    tok.save(str(path))
    return path


def test_hf_tokenizer_trained_offline(tmp_path):
    path = _train_bpe(tmp_path / "tokenizer.json")
    tok = make_tokenizer(str(path))
    text = "the lazy fox — naïve"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(tok.encode("the quick brown fox")) < len("the quick brown fox")  # merges were learned
    assert tok.eos_id == 0 and tok.pad_id == tok.vocab_size - 1 and max(ids) < tok.vocab_size
    # A directory holding tokenizer.json also works; without EOS in the file, one is added.
    assert make_tokenizer(str(tmp_path)).vocab_size == tok.vocab_size
    bare = make_tokenizer(str(_train_bpe(tmp_path / "bare.json", with_eos=False)))
    assert bare.eos_id >= 256 and bare.pad_id == bare.eos_id + 1 and bare.vocab_size == bare.pad_id + 1


def test_file_dataset_with_hf_tokenizer(tmp_path):
    tok_path = _train_bpe(tmp_path / "tokenizer.json")
    tok = make_tokenizer(str(tok_path))
    docs = make_docs(12, seed=9)
    root = write_jsonl_corpus(tmp_path / "j", docs, files=2)
    cfg = file_cfg(
        "jsonl",
        root,
        f"data.tokenizer={tok_path}",
        "data.val_fraction=0.0",
        "data.prefetch=0",
        f"model.vocab_size={padded_vocab_size(tok.vocab_size)}",
    )
    n = sum(len(tok.encode(d)) + 1 for d in docs)
    flat = flat_stream(make_dataset(cfg), n)
    assert flat.max() < tok.vocab_size and (flat == tok.eos_id).sum() == len(docs)
    cuts = np.flatnonzero(flat == tok.eos_id)
    got = [tok.decode(flat[a + 1 : b]) for a, b in zip(np.r_[-1, cuts[:-1]], cuts)]
    assert sorted(got) == sorted(docs)


def test_tokenizer_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="data.tokenizer"):
        make_tokenizer(str(tmp_path / "missing.json"))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty"))
    monkeypatch.delenv("DATA_GYM_CACHE_DIR", raising=False)
    pytest.importorskip("tiktoken")
    with pytest.raises(ValueError, match="TIKTOKEN_CACHE_DIR"):
        make_tokenizer("gpt2")


# ---------------------------------------------------------------------------
# file sources, packing, splits, sharding, state


def make_docs(n, seed=0):
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
    return [f"doc{i}: " + " ".join(rng.choice(words, size=rng.integers(1, 12))) for i in range(n)]


def write_text_corpus(root, docs):
    root.mkdir(parents=True, exist_ok=True)
    for i, d in enumerate(docs):
        (root / f"d{i:03d}.txt").write_text(d, encoding="utf-8")
    return root


def write_jsonl_corpus(root, docs, files=3):
    root.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        with open(root / f"part{f}.jsonl", "w", encoding="utf-8") as fh:
            for d in docs[f::files]:
                fh.write(json.dumps({"id": 1, "text": d, "meta": {"x": 2}}) + "\n")
    return root


def file_cfg(dataset, path, *extra):
    return cfg_with(
        f"data.dataset={dataset}",
        f"data.path={path}",
        "model.vocab_size=320",
        "train.seq_len=15",
        "train.global_batch=2",
        *extra,
    )


def split_docs(stream_tokens):
    """Documents of a flat token stream cut at EOS (a trailing partial document dropped)."""
    out, cur = [], []
    for t in stream_tokens.tolist():
        if t == BYTE.eos_id:
            out.append(BYTE.decode(cur))
            cur = []
        else:
            cur.append(t)
    return out


def flat_stream(ds, n_tokens):
    """The first `n_tokens` of the packed stream, rows in order."""
    flat = [next(ds).reshape(-1)]
    while sum(f.size for f in flat) < n_tokens:
        flat.append(next(ds).reshape(-1))
    return np.concatenate(flat)[:n_tokens]


def epoch_docs(ds, n_tokens):
    """The documents in the first `n_tokens` of the packed stream (= one epoch when n_tokens is its size)."""
    return split_docs(flat_stream(ds, n_tokens))


def split_size(docs, split, val_fraction):
    return [d for d in docs if sources.in_split(d, split, val_fraction)]


def test_packing_keeps_every_token_and_puts_eos_between_docs(tmp_path):
    docs = make_docs(40)
    root = write_text_corpus(tmp_path / "txt", docs)
    cfg = file_cfg("text", root, "data.val_fraction=0.0", "data.prefetch=0")
    ds = make_dataset(cfg)
    n_tokens = sum(len(BYTE.encode(d)) + 1 for d in docs)
    first = next(ds)
    assert first.shape == (2, 16) and first.dtype == np.int32
    two_epochs = flat_stream(make_dataset(cfg), 2 * n_tokens)
    np.testing.assert_array_equal(two_epochs[: first.size], first.reshape(-1))
    got = split_docs(two_epochs[:n_tokens])
    assert two_epochs[n_tokens - 1] == BYTE.eos_id
    assert collections.Counter(got) == collections.Counter(docs)
    # The next epoch starts right after, with every document again, in a new order.
    second = split_docs(two_epochs[n_tokens:])
    assert collections.Counter(second) == collections.Counter(docs) and second != got


def test_val_split_is_disjoint_by_document(tmp_path):
    docs = make_docs(60, seed=1)
    root = write_text_corpus(tmp_path / "txt", docs)
    cfg = file_cfg("text", root, "data.val_fraction=0.3", "data.prefetch=0")
    train, val = split_size(docs, "train", 0.3), split_size(docs, "val", 0.3)
    assert train and val
    got_train = epoch_docs(make_dataset(cfg, "train"), sum(len(BYTE.encode(d)) + 1 for d in train))
    got_val = epoch_docs(make_dataset(cfg, "val"), sum(len(BYTE.encode(d)) + 1 for d in val))
    assert sorted(got_train) == sorted(train) and sorted(got_val) == sorted(val)
    assert not set(got_train) & set(got_val)
    with pytest.raises(ValueError, match="data.val_fraction"):
        make_dataset(file_cfg("text", root, "data.val_fraction=0.0"), "val")


def test_process_shards_are_disjoint(tmp_path):
    docs = make_docs(30, seed=2)
    root = write_jsonl_corpus(tmp_path / "j", docs, files=4)
    cfg = file_cfg("jsonl", root, "data.val_fraction=0.0", "data.prefetch=0", "train.global_batch=4")
    per_process = []
    for p in range(2):
        files = sources.list_files(str(root), "jsonl")
        mine = sources.index_chunks(files, "jsonl")[p::2]
        mine_docs = [d for c in mine for d in sources.read_chunk(c)]
        n = sum(len(BYTE.encode(d)) + 1 for d in mine_docs)
        got = epoch_docs(make_dataset(cfg, process_index=p, process_count=2), n)
        assert sorted(got) == sorted(mine_docs)
        per_process.append(set(got))
    assert not per_process[0] & per_process[1]
    assert per_process[0] | per_process[1] == set(docs)


def test_jsonl_byte_ranges_read_each_line_once(tmp_path, monkeypatch):
    docs = make_docs(25, seed=3)
    root = write_jsonl_corpus(tmp_path / "j", docs, files=1)
    monkeypatch.setattr(sources, "JSONL_CHUNK_BYTES", 37)  # cuts lines in the middle
    chunks = sources.index_chunks(sources.list_files(str(root), "jsonl"), "jsonl")
    assert len(chunks) > 10
    assert [d for c in chunks for d in sources.read_chunk(c)] == docs


def test_parquet_source_ignores_other_columns(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    docs = make_docs(30, seed=4)
    root = tmp_path / "fw"
    root.mkdir()
    for f in range(2):
        part = docs[f::2]
        table = pa.table(
            {"id": [f"<urn:{i}>" for i in range(len(part))], "text": part, "score": np.linspace(0, 5, len(part))}
        )
        pq.write_table(table, root / f"shard_{f:05d}.parquet", row_group_size=4)
    chunks = sources.index_chunks(sources.list_files(str(root), "fineweb_edu"), "fineweb_edu")
    assert len(chunks) == 8  # 15 rows per file in row groups of 4
    cfg = file_cfg("fineweb_edu", root, "data.val_fraction=0.0", "data.prefetch=0")
    got = epoch_docs(make_dataset(cfg), sum(len(BYTE.encode(d)) + 1 for d in docs))
    assert sorted(got) == sorted(docs)
    pq.write_table(pa.table({"content": ["x"]}), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="'text' column"):
        make_dataset(file_cfg("fineweb_edu", tmp_path / "bad.parquet"))


@pytest.mark.parametrize("workers,prefetch", [(0, 0), (2, 2)])
def test_grain_state_round_trip(tmp_path, workers, prefetch):
    docs = make_docs(50, seed=5)
    root = write_jsonl_corpus(tmp_path / "j", docs, files=5)
    cfg = file_cfg("jsonl", root, "data.val_fraction=0.1", f"data.workers={workers}", f"data.prefetch={prefetch}")
    a = make_dataset(cfg)
    take(a, 7)  # 7 batches of 32 tokens: state lands inside a chunk
    state = json.loads(json.dumps(a.get_state()))
    expected = take(a, 30)  # crosses chunk and epoch boundaries
    b = make_dataset(cfg)
    take(b, 2)
    b.set_state(state)
    for x, y in zip(take(b, 30), expected):
        np.testing.assert_array_equal(x, y)
    # Same seed from scratch: same stream; another seed: another one.
    np.testing.assert_array_equal(next(make_dataset(cfg)), next(make_dataset(cfg)))
    other = make_dataset(file_cfg("jsonl", root, "data.val_fraction=0.1", "train.seed=3"))
    assert not all(np.array_equal(x, y) for x, y in zip(take(other, 3), take(make_dataset(cfg), 3)))
    for ds in (a, b, other):
        ds.close()


def test_file_dataset_errors(tmp_path):
    with pytest.raises(ValueError, match="data.path"):
        make_dataset(file_cfg("fineweb_edu", ""))
    with pytest.raises(ValueError, match="does not exist"):
        make_dataset(file_cfg("jsonl", tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.md").write_text("x")
    with pytest.raises(ValueError, match="no .*jsonl"):
        make_dataset(file_cfg("jsonl", tmp_path / "empty"))
    root = write_text_corpus(tmp_path / "txt", make_docs(3))
    with pytest.raises(ValueError, match="model.vocab_size=320"):
        make_dataset(file_cfg("text", root, "model.vocab_size=256"))
    with pytest.raises(ValueError, match="processes"):
        make_dataset(file_cfg("text", root, "train.global_batch=4"), process_index=0, process_count=4)
    a = make_dataset(file_cfg("text", root, "data.prefetch=0"))
    b = make_dataset(file_cfg("text", write_text_corpus(tmp_path / "txt2", make_docs(4)), "data.prefetch=0"))
    with pytest.raises(ValueError, match="different corpus"):
        b.set_state(a.get_state())


def test_empty_split_raises_instead_of_hanging(tmp_path):
    # One document whose hash puts it in train: the val shard has no data at all.
    doc = next(d for d in make_docs(50) if not sources.in_split(d, "val", 0.05))
    root = write_text_corpus(tmp_path / "txt", [doc])
    with pytest.raises(ValueError, match="no val documents"):
        next(make_dataset(file_cfg("text", root, "data.val_fraction=0.05", "data.prefetch=0"), "val"))


def test_first_batch_with_timeout():
    class Slow:
        def __next__(self):
            time.sleep(2.0)
            return np.zeros((1, 2), np.int32)

    t = time.perf_counter()
    with pytest.raises(TimeoutError, match="loader-timeout"):
        first_batch_with_timeout(Slow(), 0.2)
    assert time.perf_counter() - t < 1.5
    ds = make_dataset(cfg_with("train.seq_len=8"))
    assert first_batch_with_timeout(ds, 5.0).shape == (2, 9)

    class Broken:
        def __next__(self):
            raise ValueError("data.path broken")

    with pytest.raises(ValueError, match="broken"):
        first_batch_with_timeout(Broken(), 5.0)


# ---------------------------------------------------------------------------
# kv_recall


@pytest.mark.parametrize("placement", ["start", "random"])
def test_kv_recall_layout_and_scoring(placement):
    V, w, P, Q, T = 64, 16, 4, 3, 48
    rng = np.random.default_rng(0)
    kb = kv_recall.make_kv_batch(rng, 5, T, V, w, P, Q, placement)
    tokens_BxT1 = kb.tokens_BxT1
    assert tokens_BxT1.shape == (5, T + 1) and tokens_BxT1.dtype == np.int32
    assert tokens_BxT1.min() >= 0 and tokens_BxT1.max() < V
    np.testing.assert_array_equal(kb.answer_mask_BxT, kv_recall.answer_mask_from_tokens(tokens_BxT1, V))
    # The train step's loss mask is the same function, traced on a device array.
    traced = jax.jit(kv_recall.kv_answer_mask, static_argnums=1)(jnp.asarray(tokens_BxT1), V)
    np.testing.assert_array_equal(np.asarray(traced), kb.answer_mask_BxT)
    assert kb.answer_mask_BxT.sum() == 5 * Q
    for b in range(5):
        answers = np.flatnonzero(kb.answer_mask_BxT[b])  # target index t scores tokens[t + 1]
        for q, t in enumerate(answers):
            key = tokens_BxT1[b, t]
            pair = kb.pair_key_pos_BxQ[b, q]
            assert t == kb.query_key_pos_BxQ[b, q]
            assert tokens_BxT1[b, pair] == key and np.sum(tokens_BxT1[b, :-1] == key) == 2  # stored, queried
            if placement == "start":
                assert pair < 2 * P
            assert tokens_BxT1[b, t + 1] == tokens_BxT1[b, pair + 1]  # the answer is the stored value
            assert t - (pair + 1) > w  # the whole pair lies outside the sliding window
        # Distinct queried pairs (Q <= P): no query can copy an earlier query's answer.
        assert len(set(kb.pair_key_pos_BxQ[b])) == Q
    # At the shortest allowed length the farthest pair is still outside the window; one shorter fails.
    T_min = kv_recall.min_seq_len(w, P, Q)
    edge = kv_recall.make_kv_batch(rng, 3, T_min, V, w, P, Q, placement)
    assert (edge.query_key_pos_BxQ.min() - (2 * P - 1)) > w
    assert (edge.query_key_pos_BxQ - (edge.pair_key_pos_BxQ + 1)).min() > w
    with pytest.raises(ValueError, match="train.seq_len"):
        kv_recall.make_kv_batch(rng, 3, T_min - 1, V, w, P, Q, placement)
    if placement == "random":  # the pairs really move: offsets differ between rows
        offsets = kv_recall.make_kv_batch(rng, 64, 3 * T, V, w, P, Q, placement).pair_key_pos_BxQ.min(axis=1)
        assert len(set(offsets.tolist())) > 10
    targets_BxT = tokens_BxT1[:, 1:]
    assert kv_recall.retrieval_accuracy(targets_BxT, tokens_BxT1, V) == 1.0
    wrong = targets_BxT.copy()
    wrong[kb.answer_mask_BxT] += 1
    assert kv_recall.retrieval_accuracy(wrong, tokens_BxT1, V) == 0.0
    logits_BxTxV = np.eye(V)[wrong]
    logits_BxTxV[0, kb.query_key_pos_BxQ[0, 0], targets_BxT[0, kb.query_key_pos_BxQ[0, 0]]] = 2.0
    assert kv_recall.retrieval_counts(logits_BxTxV, tokens_BxT1, V) == (1, 5 * Q)


@pytest.mark.parametrize("placement", ["start", "random"])
def test_kv_recall_fused_pairs(placement):
    """kv_format=fused: each pair is one token 2n + k*n + (v - n), decoded here by hand."""
    # n = the most keys with n*n + 2n pair/key/value ids, 8 filler ids and the marker in V.
    assert kv_recall.vocab_layout(256, "fused") == (14, 224, 255)  # 196 + 28 + 8 + 1 = 233 <= 256 < 264
    assert kv_recall.vocab_layout(64, "fused") == (6, 48, 63)  # 36 + 12 + 9 = 57 <= 64 < 72
    with pytest.raises(ValueError, match="data.kv_format"):
        kv_recall.vocab_layout(64, "pairs")
    V, w, P, Q, T, n = 64, 16, 5, 4, 48, 6
    rng = np.random.default_rng(1)
    kb = kv_recall.make_kv_batch(rng, 6, T, V, w, P, Q, placement, "fused")
    tokens_BxT1 = kb.tokens_BxT1
    np.testing.assert_array_equal(kb.answer_mask_BxT, kv_recall.answer_mask_from_tokens(tokens_BxT1, V))
    for b in range(6):
        row = tokens_BxT1[b]
        pair_pos = np.flatnonzero((row >= 2 * n) & (row < 2 * n + n * n))
        assert len(pair_pos) == P and np.all(np.diff(pair_pos) == 1)  # P adjacent one-token pairs
        if placement == "start":
            assert pair_pos[0] == 0
        stored = {int(row[p] - 2 * n) // n: n + int(row[p] - 2 * n) % n for p in pair_pos}
        assert len(stored) == P  # distinct keys
        answers = np.flatnonzero(kb.answer_mask_BxT[b])
        assert len(answers) == Q
        for q, t in enumerate(answers):
            key, value = int(row[t]), int(row[t + 1])
            assert row[t - 1] == V - 1 and key < n and n <= value < 2 * n
            assert stored[key] == value  # the answer is the value stored with the queried key
            assert kb.pair_key_pos_BxQ[b, q] in pair_pos and t - pair_pos[-1] > w
    T_min = kv_recall.min_seq_len(w, P, Q, "fused")
    assert T_min == kv_recall.min_seq_len(w, P, Q) - P  # one token a pair instead of two
    kv_recall.make_kv_batch(rng, 2, T_min, V, w, P, Q, placement, "fused")
    with pytest.raises(ValueError, match="train.seq_len"):
        kv_recall.make_kv_batch(rng, 2, T_min - 1, V, w, P, Q, placement, "fused")


def test_kv_recall_dataset():
    cfg = cfg_with(
        "data.dataset=kv_recall",
        "model.nsa.w=32",
        "train.seq_len=80",
        "train.global_batch=4",
        "model.vocab_size=128",
        "data.kv_pairs=6",
        "data.kv_queries=4",
    )
    ds = make_dataset(cfg)
    a = take(ds, 3)
    assert a[0].shape == (4, 81) and a[0].dtype == np.int32
    ds2 = make_dataset(cfg)
    ds2.set_state(json.loads(json.dumps({**ds.get_state(), "rows": 4})))
    np.testing.assert_array_equal(next(ds2), a[1])
    assert kv_recall.answer_mask_from_tokens(a[0], 128).sum() == 16
    assert not np.array_equal(next(make_dataset(cfg, "val")), a[0])
    with pytest.raises(ValueError, match="train.seq_len"):
        make_dataset(cfg_with("data.dataset=kv_recall", "model.nsa.w=64", "train.seq_len=64"))


# ---------------------------------------------------------------------------
# bad data in the file pipeline (sources.py "Bad data")


def test_bad_records_are_skipped_counted_and_logged(tmp_path, caplog):
    docs = make_docs(10, seed=11)
    root = tmp_path / "j"
    root.mkdir()
    lines = [json.dumps({"text": d}).encode() for d in docs[:5]]
    lines[1:1] = [b'{"text": "cut off', b'{"text": "caf\xe9"}', json.dumps({"title": "no text"}).encode()]
    (root / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (root / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[5:]))
    (root / "c.jsonl").write_bytes(b"")
    # Strict reading (no on_skip) names the file and the byte of the bad line.
    chunk = ("jsonl", str(root / "a.jsonl"), 0, (root / "a.jsonl").stat().st_size)
    with pytest.raises(sources.BadDataError, match=r"a\.jsonl at byte \d+: invalid JSON"):
        sources.read_chunk(chunk)
    log = sources.SkipLog()
    assert sources.read_chunk(chunk, log) == docs[:5]
    assert log.counts == {"invalid JSON": 1, "not UTF-8": 1, "no 'text' field": 1}

    cfg = file_cfg("jsonl", root, "data.val_fraction=0.0", "data.prefetch=0")
    with caplog.at_level("WARNING", logger="nsa_jax.data"):
        ds = make_dataset(cfg)
        got = epoch_docs(ds, sum(len(BYTE.encode(d)) + 1 for d in docs))
    assert sorted(got) == sorted(docs)
    assert ds.skips.counts["empty file"] == 1 and ds.skips.counts["invalid JSON"] >= 1
    text = caplog.text
    assert "c.jsonl: empty file" in text and "a.jsonl at byte" in text and "not UTF-8" in text


def test_bad_text_and_parquet_files(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    docs = make_docs(4, seed=12)
    root = write_text_corpus(tmp_path / "txt", docs)
    (root / "latin1.txt").write_bytes("naïve".encode("latin-1"))
    (root / "empty.txt").write_bytes(b"")
    ds = make_dataset(file_cfg("text", root, "data.val_fraction=0.0", "data.prefetch=0"))
    assert sorted(epoch_docs(ds, sum(len(BYTE.encode(d)) + 1 for d in docs))) == sorted(docs)
    assert ds.skips.counts["not UTF-8"] >= 1 and ds.skips.counts["empty file"] == 1

    fw = tmp_path / "fw"
    fw.mkdir()
    pq.write_table(pa.table({"text": pa.array([docs[0].encode(), b"\xff bad", docs[1].encode()])}), fw / "a.parquet")
    ds = make_dataset(file_cfg("fineweb_edu", fw, "data.val_fraction=0.0", "data.prefetch=0"))
    assert sorted(epoch_docs(ds, sum(len(BYTE.encode(d)) + 1 for d in docs[:2]))) == sorted(docs[:2])
    assert ds.skips.counts == {"not UTF-8": ds.skips.counts["not UTF-8"]}
    # Whole-file problems stop the stream before the first batch, naming the file.
    (fw / "b.parquet").write_bytes(b"PAR1 garbage")
    with pytest.raises(sources.BadDataError, match=r"b\.parquet: corrupt file"):
        make_dataset(file_cfg("fineweb_edu", fw))
    (fw / "b.parquet").write_bytes(b"")  # empty: skipped
    make_dataset(file_cfg("fineweb_edu", fw, "data.prefetch=0"))
    j = tmp_path / "j"
    j.mkdir()
    (j / "a.jsonl").write_text(json.dumps({"content": "x"}) + "\n")
    with pytest.raises(sources.BadDataError, match=r"a\.jsonl at line 1: no 'text' field \(first record has keys"):
        make_dataset(file_cfg("jsonl", j))
    with pytest.raises(ValueError, match=r"no \*\.jsonl/\*\.json files for data.dataset=jsonl \(it holds 6 \.txt"):
        make_dataset(file_cfg("jsonl", root))


def test_all_bad_corpus_raises_instead_of_hanging(tmp_path):
    root = tmp_path / "j"
    root.mkdir()
    (root / "a.jsonl").write_bytes(b"{not json\n{also not\n")
    ds = make_dataset(file_cfg("jsonl", root, "data.val_fraction=0.0", "data.prefetch=0"))
    with pytest.raises(ValueError, match="no train documents"):
        next(ds)
