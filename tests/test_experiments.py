"""The learning studies of experiments/: each CLI at tiny sizes, and the measures they print.

The CLIs run in a subprocess, as a user would run them; no learning outcome is asserted
(the runs are a step or two long), only what each study computes from what it is given.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import TINY_RUN, run_cli, run_module, set_flags


@pytest.mark.slow
def test_kv_recall_ablation_cli_variant_overrides(tmp_path):
    """A variant's own overrides apply to its model only; --data-window keeps the rows the same."""
    out = tmp_path / "kv.json"
    run_cli(
        "experiments.kv_recall_ablation",
        "--steps",
        "1",
        "--eval-every",
        "1",
        "--eval-batches",
        "1",
        "--variants",
        "win;model.nsa.w=512",
        "--data-window",
        "64",
        "--set",
        "model.n_layers=1",
        "--set",
        "data.kv_format=fused",
        "--json",
        str(out),
    )
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    assert row["variant"] == "win model.nsa.w=512" and row["branches"] == "win"
    assert row["answers"] == 8 * 4 and 0.0 <= row["accuracy"] <= 1.0


def test_selection_diagnosis_measures_on_constructed_attention():
    """Zero queries attend uniformly; a query equal to (a large multiple of) the pair token's key finds it."""
    from experiments.selection_diagnosis import diagnose, free_blocks

    B, T, H, K, D, l, d, lp = 1, 64, 2, 1, 8, 8, 4, 8
    rng = np.random.default_rng(0)
    k = rng.normal(size=(B, T, K, D))
    kc = rng.normal(size=(B, (T - l) // d + 1, K, D))
    qpos, tpos = np.array([[60, 63]]), np.array([[20, 13]])
    uniform = diagnose(np.zeros((B, T, H, D)), kc, k, qpos, tpos, l=l, d=d, lp=lp)
    assert uniform["answers"] == 2
    assert uniform["pair-token mass"] == pytest.approx(np.mean([1 / 61, 1 / 64]))
    assert uniform["target on block"] == pytest.approx(np.mean([1 / len(free_blocks(t, lp)) for t in (60, 63)]))
    assert uniform["uniform"] == pytest.approx(uniform["target on block"])
    q = np.zeros((B, T, H, D))
    for t, p in zip(qpos[0], tpos[0]):
        k[0, p, 0] *= 4.0 / np.linalg.norm(k[0, p, 0])  # longer than any other key (norm ~ sqrt(D))
        q[0, t, :] = 20.0 * k[0, p, 0]
    sharp = diagnose(q, kc, k, qpos, tpos, l=l, d=d, lp=lp)
    assert sharp["pair-token mass"] > 0.99 and sharp["target on block"] > 0.99


def test_experiments_paired_differences_seed_by_seed():
    from experiments.compare import paired

    def run(variant, seed, accs):
        return {"variant": variant, "seed": seed, "curve": [{"step": s, "accuracy": a} for s, a in accs]}

    runs = [
        run("ref", 1, [(0, 0.0), (10, 0.2), (20, 0.3)]),
        run("ref", 2, [(0, 0.0), (10, 0.1), (20, 0.5)]),
        run("ref", 3, [(0, 0.0), (10, 0.1)]),  # no partner seed 3 below
        run("b", 1, [(0, 0.0), (10, 0.6), (20, 0.4)]),
        run("b", 2, [(0, 0.0), (10, 0.3), (20, 0.9)]),
        run("c", 4, [(0, 0.0), (10, 0.9)]),  # no seed in common with ref: left out
    ]
    (name, step, diffs, m, se), *rest = paired(runs, "ref", "accuracy")
    assert not rest and name == "b" and step == 20
    assert [s for s, _ in diffs] == [1, 2]
    np.testing.assert_allclose([d for _, d in diffs], [0.1, 0.4])
    np.testing.assert_allclose(m, 0.25)
    np.testing.assert_allclose(se, np.std([0.1, 0.4], ddof=1) / np.sqrt(2))


def test_experiments_warn_when_runs_mix_software_environments():
    import importlib.metadata as md

    from experiments.compare import environments_warning, software

    here = software()
    assert here["jax"] == md.version("jax") and here["numpy"] == md.version("numpy")
    other = {**here, "numpy": "0.0.1"}
    same = [{"variant": "a", "seed": 1, "software": here}, {"variant": "b", "seed": 1, "software": dict(here)}]
    assert environments_warning(same) is None
    mixed = [*same, {"variant": "c", "seed": 2, "software": other}, {"variant": "d", "seed": 3}]
    text = environments_warning(mixed)
    assert text.startswith("warning: these runs come from 3 software environments")
    assert "a/1, b/1" in text and "numpy 0.0.1" in text and "versions not recorded: d/3" in text


@pytest.mark.slow
def test_branch_scale_measures_each_branch_tensor():
    """Scaling the v_slc projection by 3 triples the v_slc figure and leaves every other tensor's as it was."""
    from flax.traverse_util import flatten_dict, unflatten_dict

    from experiments.branch_scale import TENSORS, tensor_rms
    from nsa_jax.config import load_config
    from nsa_jax.model import NSALM

    cfg = load_config("cpu_tiny", ["model.n_layers=1", "train.seq_len=64"])
    model = NSALM(cfg.model)
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 64), 0, cfg.model.vocab_size)
    params = model.init(jax.random.PRNGKey(1), tokens)["params"]
    before = {k: float(v) for k, v in tensor_rms(model, params, tokens).items()}
    assert sorted(before) == sorted(TENSORS) and all(v > 0 for v in before.values())
    flat = flatten_dict(params)
    scaled = {k: v * 3.0 if "v_slc" in k else v for k, v in flat.items()}
    assert sum("v_slc" in k for k in flat) == 1
    after = {k: float(v) for k, v in tensor_rms(model, unflatten_dict(scaled), tokens).items()}
    for name in TENSORS:
        want = before[name] * (3.0 if name == "v_slc" else 1.0)
        assert after[name] == pytest.approx(want, rel=1e-5), name


def test_needle_selection_finds_the_key_blocks_and_the_share_selected():
    """The key's blocks from the row's text (str.find on bytes); the share from a hand-made index array."""
    from experiments.needle_selection import key_blocks, selected_share
    from nsa_jax.data.needle import make_needle_row
    from nsa_jax.data.tokenizers import ByteTokenizer

    tok, lp = ByteTokenizer(), 8
    hay = np.frombuffer(b"abcdefghij" * 40, np.uint8).astype(np.int32)
    row = make_needle_row(hay, 300, 0.5, "71432", tok)
    text = bytes(row.tokens_T1.astype(np.uint8)).decode()
    first = text.find("71432")
    second = text.find("71432", first + 1)
    assert first >= 0 and second > first and second < text.find("What is")  # both copies in the needle
    assert key_blocks(row, tok, lp) == {(p + j) // lp for p in (first, second) for j in range(5)}

    idx_LxTxKxN = np.full((2, 10, 2, 3), -1)
    idx_LxTxKxN[0, 7] = [[3, 0, 1], [3, -1, -1]]
    idx_LxTxKxN[0, 8] = [[0, 1, 3], [0, 1, 2]]
    idx_LxTxKxN[1, 7] = [[5, 6, -1], [0, 1, 2]]
    idx_LxTxKxN[1, 8] = [[0, 5, -1], [4, 5, 6]]
    idx_LxTxKxN[1, 9] = [[3, 3, 3], [3, 3, 3]]  # not an answer query
    share = selected_share(idx_LxTxKxN, np.array([7, 8]), {3, 5})
    np.testing.assert_allclose(share, [[1.0, 0.5], [1.0, 0.5]])
    assert selected_share(idx_LxTxKxN, np.array([7, 8]), {9}).sum() == 0


def test_needle_seeds_prints_launch_stages_report_of_an_out_dir(tmp_path, capsys):
    """The reading and the report are launch.stages's (launch/recipe_results.py); the CLI reads a --out of
    launch.stages later."""
    from experiments import needle_seeds
    from launch import recipe_results

    for recipe, seed, acc in (("rope", 1, [1.0, 0.875]), ("rope", 2, [1.0, 1.0]), ("plain", 1, [0.0, 0.5])):
        d = tmp_path / "out" / recipe / f"nsa_s{seed}"
        (d / "eval").mkdir(parents=True)
        (d / "val.csv").write_text("step,retrieval_acc\n800,0.9\n1100,\n")
        (d / "eval" / "evaluation.json").write_text(json.dumps({"needle": {"lengths": [1024], "accuracy": [acc]}}))
    want = recipe_results.report(recipe_results.read(tmp_path / "out"))
    assert needle_seeds.main([str(tmp_path / "out"), "--json", str(tmp_path / "runs.json")]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed == want and printed[0] == "== plain"
    assert any(line.startswith("  2 evaluated: mean 0.97 ") for line in printed)
    saved = json.loads((tmp_path / "runs.json").read_text())
    assert sorted(saved) == ["plain", "rope"] and [r["recall"] for r in saved["rope"]] == [[[800, 0.9]]] * 2
    assert needle_seeds.main([str(tmp_path / "missing")]) == 2
    assert "error:" in capsys.readouterr().err
    assert needle_seeds.main([str(tmp_path / "out"), "--variant", "full"]) == 2
    assert "no runs (NAME/full_sSEED)" in capsys.readouterr().err


def _loads_by_sets(idx_BxTxKxN: np.ndarray, positions: int) -> float:
    """tile_loads by Python sets: the union of each aligned group's valid blocks, per row and KV head."""
    B, T, K, _ = idx_BxTxKxN.shape
    union = single = 0
    for b in range(B):
        for k in range(K):
            sets = [{int(j) for j in idx_BxTxKxN[b, t, k] if j >= 0} for t in range(T)]
            single += sum(len(s) for s in sets)
            union += sum(len(set().union(*sets[g : g + positions])) for g in range(0, T, positions))
    return union / single


def test_selection_locality_counts_the_blocks_a_program_of_p_positions_loads():
    from experiments.selection_locality import locality, same_set_share, tile_loads
    from nsa_jax.kernels.reference import random_block_indices

    idx = random_block_indices(np.random.default_rng(1), 2, 45, 2, 4, 8)  # T not a multiple of P; -1 slots early
    assert (idx < 0).any()
    for p in (1, 2, 4, 8):
        assert tile_loads(idx, p) == pytest.approx(_loads_by_sets(idx, p)), p
    assert tile_loads(idx, 1) == 1.0
    # Runs of 8 positions with one selection: a program of P <= 8 positions loads one position's blocks.
    runs = idx[:, (np.arange(45) // 8) * 8]
    assert tile_loads(runs, 4) == pytest.approx(_loads_by_sets(runs, 4))
    assert tile_loads(runs[:, :40], 4) == pytest.approx(1 / 4) and tile_loads(runs[:, :40], 8) == pytest.approx(1 / 8)
    # The same set regardless of slot order; t and t - 1 compared per KV head.
    same = np.array([[[[0, 2, -1]], [[2, 0, -1]], [[0, 1, -1]], [[1, 0, -1]]]])
    assert same_set_share(same) == pytest.approx(2 / 3)
    figures = locality(idx)
    assert set(figures) == {
        "loads_p2",
        "loads_p4",
        "loads_p8",
        "same_set",
        "union_p1",
        "union_p2",
        "union_p4",
        "union_p8",
    }
    # The union of P positions, counted by Python sets over whole aligned groups.
    for p in (1, 2, 4, 8):
        whole = 45 - 45 % p
        sizes = [
            len({int(i) for t in range(g, g + p) for i in idx[b, t, k] if i >= 0})
            for b in range(2)
            for k in range(2)
            for g in range(0, whole, p)
        ]
        assert figures[f"union_p{p}"] == pytest.approx(np.mean(sizes)), p


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """(a one-step cpu_tiny run at T=128, a text file): what the checkpoint-reading CLIs read."""
    root = tmp_path_factory.mktemp("tiny_run")
    out = root / "run"
    sets = set_flags([*TINY_RUN, "train.seq_len=128", "logging.tensorboard=false"])
    train = run_module("launch.train", "--config", "cpu_tiny", "--steps", "1", "--out-dir", str(out), *sets)
    assert train.returncode == 0, train.stderr[-2000:]
    text = root / "text.txt"
    text.write_text("All work and no play makes a dull model. " * 40)
    return out, text


@pytest.mark.slow
def test_selection_locality_cli_reads_a_checkpoint(tmp_path, tiny_run):
    out, text = tiny_run
    report = tmp_path / "locality.json"
    proc = run_cli(
        "experiments.selection_locality", "--ckpt", str(out), "--rows", "2", "--text", str(text), "--json", str(report)
    )
    assert "random" in proc.stdout and "P=4" in proc.stdout
    (res,) = json.loads(report.read_text())
    assert (res["length"], res["rows"]) == (128, 2) and len(res["layers"]) == 1
    for r in (*res["layers"], res["random"]):
        for p in (2, 4, 8):
            assert 1 / p - 1e-9 <= r[f"loads_p{p}"] <= 1.0
    missing = run_cli("experiments.selection_locality", "--ckpt", str(tmp_path / "nowhere"), check=False)
    assert missing.returncode != 0 and "error:" in missing.stderr


def _recall_reference(q, k, idx, lp):
    """Float64 loops: (recall, best) of every query, from the module docstring's definitions."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    B, T, H, D = q.shape
    K, N = k.shape[2], idx.shape[-1]
    G, Nb = H // K, -(-T // lp)
    out = np.ones((B, T, K, 2))
    for b in range(B):
        for t in range(N * lp, T):
            for kv in range(K):
                mass = np.zeros(Nb)
                for h in range(kv * G, (kv + 1) * G):
                    s = k[b, : t + 1, kv] @ q[b, t, h] / np.sqrt(D)
                    p = np.exp(s - s.max())
                    np.add.at(mass, np.arange(t + 1) // lp, p / p.sum() / G)
                chosen = {int(i) for i in idx[b, t, kv] if i >= 0}
                forced = {0, t // lp - 1, t // lp}
                free = sorted((mass[j] for j in range(Nb) if j not in forced and j <= t // lp), reverse=True)
                out[b, t, kv] = sum(mass[j] for j in chosen), sum(mass[j] for j in forced) + sum(free[: N - 3])
    return out


def test_selection_recall_measures_the_selected_and_the_best_blocks_against_loops():
    from experiments.selection_recall import buckets, recall_and_best
    from nsa_jax.kernels.reference import random_block_indices

    B, T, H, K, D, lp, N = 2, 70, 4, 2, 8, 8, 4
    keys = jax.random.split(jax.random.PRNGKey(7), 2)
    q = jax.random.normal(keys[0], (B, T, H, D)) * 2.0
    k = jax.random.normal(keys[1], (B, T, K, D)) * 2.0
    idx = random_block_indices(np.random.default_rng(3), B, T, K, N, lp)
    got = recall_and_best(q, k, idx, lp=lp, chunk=16)  # T not a multiple of the chunk
    ref = _recall_reference(q, k, idx, lp)
    np.testing.assert_allclose(got, ref, atol=2e-5)
    real = got[:, N * lp :]
    assert np.all(real[..., 0] <= real[..., 1] + 1e-6) and real[..., 0].min() < 0.9  # random choices miss mass
    assert buckets(1024, 8192) == [(1024, 2048), (2048, 4096), (4096, 8192)]
    assert buckets(1024, 3000) == [(1024, 2048), (2048, 3000)]


def test_the_ceiling_trial_selects_the_best_n_blocks_of_the_full_attention(monkeypatch):
    """experiments/scorer_trial.py's ceiling (through the minmax scorer's XLA path) catches exactly the
    best-n share of the loop reference; the minmax bound on the same keys does not."""
    from experiments.scorer_trial import ceiling_block_scores
    from nsa_jax.kernels import scorers

    B, T, H, K, D, lp, N = 2, 70, 4, 2, 8, 8, 4
    keys = jax.random.split(jax.random.PRNGKey(11), 2)
    q = jax.random.normal(keys[0], (B, T, H, D)) * 2.0
    k = jax.random.normal(keys[1], (B, T, K, D)) * 2.0
    bound = scorers.select_minmax_xla(q, k, lp=lp, n=N, sub=lp, query_chunk=16)
    monkeypatch.setattr(scorers, "minmax_block_scores", ceiling_block_scores)
    ceiling = scorers.select_minmax_xla(q, k, lp=lp, n=N, sub=1, query_chunk=16)
    got = _recall_reference(q, k, np.asarray(ceiling), lp)[:, N * lp :]
    np.testing.assert_allclose(got[..., 0], got[..., 1], atol=1e-5)
    short = _recall_reference(q, k, np.asarray(bound), lp)[:, N * lp :]
    assert (short[..., 1] - short[..., 0]).max() > 0.01  # a cheap scorer misses mass here
    with pytest.raises(ValueError, match="scorer_sub must be 1"):
        scorers.select_minmax_xla(q, k, lp=lp, n=N, sub=2)


def test_the_rescore_trial_reranks_cmps_candidates_by_their_exact_mass():
    """rescore:M: with every block a candidate it is the ceiling (the loop reference's best-n share);
    with M = n it keeps the candidates themselves."""
    from experiments.scorer_trial import rescore_select
    from nsa_jax.kernels.xla import select_blocks

    B, T, H, K, D, lp, N = 1, 70, 4, 2, 8, 8, 4
    keys = jax.random.split(jax.random.PRNGKey(5), 3)
    q = jax.random.normal(keys[0], (B, T, H, D)) * 2.0
    k = jax.random.normal(keys[1], (B, T, K, D)) * 2.0
    cmp = jax.random.uniform(keys[2], (B, T, K, -(-T // lp)))  # stand-in compressed scores
    every = rescore_select(-(-T // lp))(q, k, lp=lp, n=N, sub=lp, plus_scores=cmp)
    got = _recall_reference(q, k, np.asarray(every), lp)[:, N * lp :]
    np.testing.assert_allclose(got[..., 0], got[..., 1], atol=1e-5)
    same = np.sort(np.asarray(rescore_select(N)(q, k, lp=lp, n=N, sub=lp, plus_scores=cmp)), -1)
    np.testing.assert_array_equal(same, np.sort(np.asarray(select_blocks(cmp, lp, N)), -1))


@pytest.mark.parametrize("sub", [1, 4, 8])
def test_the_lse_trial_scores_blocks_by_their_sub_block_means(monkeypatch, sub):
    """lse:S against float64 loops: per head, a complete block's log-sum-exp of its sub-blocks' mean-key
    logits, softmax over the complete blocks, summed over the group's heads."""
    from experiments import scorer_trial
    from nsa_jax.kernels import scorers

    B, T, H, K, D, lp = 1, 40, 4, 2, 8, 8
    keys = jax.random.split(jax.random.PRNGKey(3), 2)
    q = np.asarray(jax.random.normal(keys[0], (B, T, H, D)) * 1.5, np.float64)
    k = np.asarray(jax.random.normal(keys[1], (B, T, K, D)) * 1.5, np.float64)
    for name in ("key_bounds", "bound_block_logits", "minmax_block_scores"):  # restored after the test
        monkeypatch.setattr(scorers, name, getattr(scorers, name))
    assert scorer_trial.install(f"lse:{sub}") == sub
    kmin, kmax = scorers.key_bounds(jnp.asarray(k, jnp.float32), lp, sub)
    t_T = jnp.arange(T, dtype=jnp.int32)
    got = np.asarray(
        scorers.minmax_block_scores(jnp.asarray(q, jnp.float32), kmin, kmax, t_T, lp=lp, sub=sub, scale=D**-0.5)
    )
    G, Nb = H // K, -(-T // lp)
    for t in range(T):
        complete = [j for j in range(Nb) if (j + 1) * lp <= t + 1]
        for kv in range(K):
            want = np.zeros(Nb)
            for h in range(kv * G, (kv + 1) * G):
                lse = []
                for j in complete:
                    means = k[0, j * lp : (j + 1) * lp, kv].reshape(lp // sub, sub, D).mean(axis=1)
                    s = means @ q[0, t, h] / np.sqrt(D)
                    lse.append(s.max() + np.log(np.exp(s - s.max()).sum()))
                if complete:
                    p = np.exp(np.array(lse) - max(lse))
                    want[complete] += p / p.sum()
            np.testing.assert_allclose(got[0, t, kv][complete], want[complete], atol=1e-5)


@pytest.mark.slow
def test_selection_recall_cli_reads_a_checkpoint(tmp_path, tiny_run):
    out, text = tiny_run
    report = tmp_path / "recall.json"
    # cpu_tiny selects n=4 blocks of lp=32: every block up to 128, a real choice beyond.
    args = ["--ckpt", str(out), "--length", "256", "--text", str(text)]
    proc = run_cli("experiments.selection_recall", *args, "--scorers", "rescore:8", "--json", str(report))
    assert "best n blocks" in proc.stdout and "mean" in proc.stdout
    (res,) = json.loads(report.read_text())
    assert res["length"] == 256 and len(res["layers"]) == 1 and list(res["mean"]) == ["128-256"]
    assert res["columns"] == ["selected (cmp)", "rescore:8", "best n blocks"]
    for recall, rescored, best in res["layers"][0].values():
        assert 0.0 < recall <= best + 1e-6 <= 1.0 + 2e-6 and rescored <= best + 1e-6
    # 8 blocks = every block at 256: rescore is then the ceiling itself.
    assert abs(rescored - best) < 1e-5
    bad = run_cli("experiments.selection_recall", *args, "--scorers", "rescore:2", check=False)
    assert bad.returncode != 0 and "at least n = 4" in bad.stderr
    short = run_cli("experiments.selection_recall", "--ckpt", str(out), "--length", "128", check=False)
    assert short.returncode != 0 and "n*lp" in short.stderr
    missing = run_cli("experiments.selection_recall", "--ckpt", str(tmp_path / "nowhere"), check=False)
    assert missing.returncode != 0 and "error:" in missing.stderr


def test_needle_selection_measures_the_needle_mass_and_its_selected_part_against_loops():
    from experiments.needle_selection import needle_mass, summarise
    from nsa_jax.kernels.reference import random_block_indices

    T, H, K, D, lp, N = 90, 6, 3, 8, 8, 3
    keys = jax.random.split(jax.random.PRNGKey(11), 2)
    q_TxHxD = np.asarray(jax.random.normal(keys[0], (T, H, D))) * 2.0
    k_TxKxD = np.asarray(jax.random.normal(keys[1], (T, K, D))) * 2.0
    idx_TxKxN = random_block_indices(np.random.default_rng(5), 1, T, K, N, lp)[0]
    needle_T = np.zeros(T, bool)
    needle_T[21:35] = True  # across blocks 2-4, so that a selection may hold part of it
    qpos_Q = np.array([70, 77, 89])
    mass, on_sel = needle_mass(q_TxHxD[qpos_Q], k_TxKxD, idx_TxKxN[qpos_Q], qpos_Q, needle_T, lp=lp)
    G = H // K
    for i, t in enumerate(qpos_Q):
        for kv in range(K):
            s = q_TxHxD[t, kv * G : (kv + 1) * G].astype(np.float64) @ k_TxKxD[: t + 1, kv].astype(np.float64).T
            w = np.exp(s / np.sqrt(D) - (s / np.sqrt(D)).max(-1, keepdims=True))
            w = (w / w.sum(-1, keepdims=True)).mean(0)
            chosen = {int(j) for j in idx_TxKxN[t, kv] if j >= 0}
            want = sum(w[j] for j in range(t + 1) if needle_T[j])
            want_sel = sum(w[j] for j in range(t + 1) if needle_T[j] and j // lp in chosen)
            np.testing.assert_allclose([mass[i, kv], on_sel[i, kv]], [want, want_sel], rtol=1e-4, atol=1e-6)
    assert np.all(on_sel <= mass + 1e-9) and on_sel.sum() < mass.sum()  # random choices miss part of it
    fig = summarise(mass, on_sel)
    np.testing.assert_allclose(fig["on_selected"], on_sel.sum() / mass.sum())
    np.testing.assert_allclose(fig["wholly"], np.mean(on_sel / mass > 0.99))
    assert fig["max_mass"] == mass.max()


@pytest.mark.slow
def test_needle_selection_cli_reads_a_checkpoint_on_the_passkey_rows(tmp_path, tiny_run):
    out, text = tiny_run
    report = tmp_path / "needle.json"
    # cpu_tiny selects n=4 blocks of lp=32: a real choice past 128 tokens.
    args = ["--ckpt", str(out), "--suite", "passkey", "--length", "256", "--text", str(text), "--samples", "1"]
    proc = run_cli("experiments.needle_selection", *args, "--depths", "0.2,0.8", "--json", str(report))
    assert "share of it on selected blocks" in proc.stdout and "layer 0:" in proc.stdout
    (res,) = json.loads(report.read_text())
    assert (res["suite"], res["length"], res["depths"]) == ("passkey", 256, [0.2, 0.8])
    assert all(x < 0 for x in res["logprob"]) and len(res["exact"]) == 2
    (layer,) = res["layers"]
    assert len(layer["selected"]) == 1 and 0.0 <= layer["selected"][0] <= 1.0
    assert 0.0 < layer["mass"] <= layer["max_mass"] <= 1.0 + 1e-6
    assert 0.0 <= layer["on_selected"] <= 1.0 + 1e-6 and 0.0 <= layer["wholly"] <= 1.0
    # The answers scored as launch.evaluate's passkey suite scores the same rows (its own scorer).
    ev = ["--ckpt", str(out), "--suites", "passkey", "--lengths", "256", "--text", str(text), "--samples", "1"]
    run_cli("launch.evaluate", *ev, "--depths", "0.2,0.8", "--out", str(tmp_path / "eval"))
    suite = json.loads((tmp_path / "eval" / "evaluation.json").read_text())["passkey"]
    np.testing.assert_allclose(res["logprob"], suite["logprob"][0], rtol=1e-4, atol=1e-4)
    assert res["exact"] == suite["accuracy"][0]
    needle = run_cli("experiments.needle_selection", *args[:2], *args[4:], "--depths", "0.5")  # the needle suite
    assert "needle L=256" in needle.stdout and "layer 0:" in needle.stdout
    bad = run_cli("experiments.needle_selection", *args, "--depths", "half", check=False)
    assert bad.returncode == 2 and "error: argument --depths" in bad.stderr
    wrong = run_cli("experiments.needle_selection", *args, "--set", "model.nsa.n=zero", check=False)
    assert wrong.returncode != 0 and "error:" in wrong.stderr and "model.nsa.n" in wrong.stderr
