"""`dataset: reviews` (nsa_jax/data/reviews.py): the strategy study's fine-tune, prompt -> answer.

The rows' layout against the template read back with the byte tokenizer, the answer alone in the
loss, Yelp Review Full's files (parquet, CSV) and their bad forms in one line, an exact resumable
stream whose steps do not depend on the process count, and the fine-tune trained by every strategy
on 2 host devices to the same losses.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from launch.reviews import main as reviews_main
from nsa_jax.config import load_config
from nsa_jax.data import make_dataset
from nsa_jax.data.reviews import ANSWER, PROMPT, make_row, read_examples, split_examples
from nsa_jax.data.targets import LabeledRows
from nsa_jax.data.tokenizers import ByteTokenizer
from nsa_jax.mesh import make_mesh, put_batch
from nsa_jax.step import step as S
from nsa_jax.step import strategies

from helpers import host_train_state

TOK = ByteTokenizer()
TEXTS = [f"review {i}: " + "good food and kind staff. " * (i % 7 + 1) for i in range(40)]


def _write(tmp_path, name="reviews.parquet", labels=None, texts=TEXTS):
    labels = [i % 5 for i in range(len(texts))] if labels is None else labels
    path = tmp_path / name
    pq.write_table(pa.table({"label": pa.array(labels, pa.int64()), "text": texts}), path)
    return path


def _cfg(path, *extra):
    sets = ["data.dataset=reviews", f"data.path={path}", "model.vocab_size=320", "train.seq_len=96"]
    return load_config("cpu_tiny", [*sets, "train.global_batch=4", "data.val_fraction=0.25", *extra])


def test_a_row_is_the_prompt_then_the_answer_alone_in_the_loss():
    long = "word " * 100
    tokens, weights, answers = make_row(TOK, long, 3, 97)
    text = TOK.decode([int(t) for t in tokens if t < 256])
    head, tail = PROMPT.split("{text}")
    assert text.startswith(head + "word word") and text.endswith(tail + ANSWER.format(stars=4))
    assert len(text) == 96  # the review cut so the row holds the prompt, the answer and the eos
    assert tokens[-1] == TOK.eos_id
    # Targets t read tokens[t + 1]: the answer " 4" and its eos, nothing else.
    scored = np.nonzero(weights)[0]
    assert [int(tokens[t + 1]) for t in scored] == [*TOK.encode(" 4"), TOK.eos_id]
    assert [int(tokens[t + 1]) for t in np.nonzero(answers)[0]] == TOK.encode("4")  # the digit: the rating
    short, w, a = make_row(TOK, "ok", 0, 97)
    assert np.all(short[np.nonzero(w)[0][-1] + 1 :] == TOK.eos_id) and w.sum() == 3 and a.sum() == 1
    with pytest.raises(ValueError, match=r"train.seq_len must be >= \d+ for data.dataset=reviews"):
        make_row(TOK, "ok", 0, 40)


def test_parquet_and_csv_files_read_alike_and_bad_files_are_one_line(tmp_path):
    _write(tmp_path)
    csv_dir = tmp_path / "csv"
    csv_dir.mkdir()
    lines = ["label,text"] + [f'{i % 5},"{t}"' for i, t in enumerate(TEXTS)]
    (csv_dir / "train.csv").write_text("\n".join(lines) + "\n")
    labels, texts = read_examples(str(tmp_path / "reviews.parquet"))
    labels2, texts2 = read_examples(str(csv_dir))
    assert texts == texts2 == TEXTS and labels.tolist() == labels2.tolist() == [i % 5 for i in range(40)]
    pq.write_table(pa.table({"stars": [1], "body": ["x"]}), tmp_path / "wrong.parquet")
    with pytest.raises(ValueError, match=r"wrong.parquet has columns stars, body; data.dataset=reviews needs label"):
        read_examples(str(tmp_path / "wrong.parquet"))
    _write(tmp_path, "six.parquet", labels=[0, 6], texts=["a", "b"])
    with pytest.raises(ValueError, match=r"six.parquet: row 1 has label 6; labels are 0-4"):
        read_examples(str(tmp_path / "six.parquet"))
    (tmp_path / "h.csv").write_text("text,score\nx,1\n")
    with pytest.raises(ValueError, match=r"h.csv has columns text, score"):
        read_examples(str(tmp_path / "h.csv"))


def test_the_split_is_fixed_and_the_stream_exact_on_any_process_count(tmp_path):
    path = _write(tmp_path)
    val, train = split_examples(40, 0.25, "val"), split_examples(40, 0.25, "train")
    assert len(val) == 10 and len(train) == 30 and not set(val) & set(train)
    assert make_dataset(_cfg(path, "train.seed=1"), "val").labels.tolist() == (
        make_dataset(_cfg(path, "train.seed=2"), "val").labels.tolist()
    )
    ref = make_dataset(_cfg(path))
    steps = [next(ref) for _ in range(10)]  # past an epoch of 30 examples: a new order
    assert isinstance(steps[0], LabeledRows) and steps[0].tokens.shape == (4, 97)
    two = [make_dataset(_cfg(path), process_index=p, process_count=2) for p in range(2)]
    for want in steps[:3]:
        got = [next(ds) for ds in two]
        for field in range(3):
            np.testing.assert_array_equal(np.concatenate([g[field] for g in got]), want[field])
    state = json.loads(json.dumps(two[0].get_state()))
    again = make_dataset(_cfg(path))
    again.set_state(state)
    for want in steps[3:]:
        np.testing.assert_array_equal(next(again).tokens, want.tokens)
    epoch = np.concatenate([s.tokens for s in steps[:8]])[:30]  # the first epoch: every train example once
    assert len({r.tobytes() for r in epoch}) == 30


def test_the_standard_library_set_is_written_once(tmp_path, capsys):
    out = tmp_path / "stdlib.parquet"
    assert reviews_main([str(out)]) == 0
    labels, texts = read_examples(str(out))
    assert sorted(set(labels.tolist())) == [0, 1, 2, 3, 4] and len(texts) > 500
    assert "examples (label package count: 0 asyncio" in capsys.readouterr().out
    assert reviews_main([str(out)]) == 2 and "exists" in capsys.readouterr().err
    assert reviews_main([str(tmp_path / "x.csv")]) == 2


STRATEGIES = [("dp", []), ("dp", ["parallel.overlap_reduce=true"]), ("pmap", []), ("gspmd", [])]
STRATEGIES += [("zero1", []), ("zero1", ["parallel.overlap_reduce=true"]), ("fsdp", [])]


@pytest.mark.slow
def test_the_fine_tune_trains_alike_under_every_strategy(tmp_path):
    """The study's claim on the fine-tune: dp, dp with the reduction in the backward, pmap, gspmd,
    zero1 and fsdp (fp32 reduction) on 2 host devices give the same losses, step by step."""
    path = _write(tmp_path)
    base = ["model.attention=dense", "model.d_model=64", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1"]
    base += ["model.d_ff=128", "parallel.grad_reduce_dtype=float32", "train.accumulate=2", "train.warmup=0"]
    cfg = _cfg(path, *base)
    ds = make_dataset(cfg)
    batches = [jax.tree.map(lambda *x: np.stack(x), next(ds), next(ds)) for _ in range(4)]
    host = host_train_state(cfg, strategies.state_shapes(cfg), seed=4, scale=0.2)
    losses = {}
    for strategy, extra in STRATEGIES:
        run = dataclasses.replace(cfg, parallel=_cfg(path, *base, f"parallel.strategy={strategy}", *extra).parallel)
        mesh = make_mesh(run, jax.devices()[:2])
        plan = S.make_plan(run, mesh)
        step, state = S.make_train_step(plan), jax.device_put(host, plan.state)
        out = []
        for batch in batches:
            state, m = step(state, put_batch(batch, mesh))
            out.append(float(m["loss"]))
        losses[strategy + "+".join(["", *extra])] = out
    want = losses["dp"]
    assert want[-1] < want[0]  # it learns the answers
    for name, got in losses.items():
        np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=name)
