"""Config loading and validation, and the info command."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
import yaml

from nsa_jax.config import ConfigError, load_config, to_dict
from nsa_jax.info import describe, keys_per_query, learning_options, parameter_counts
from nsa_jax.rundir.resume import config_from_dict, resume_conflicts

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_shipped_configs_load():
    prod = load_config("a100_pcie")
    assert (prod.model.d_model, prod.model.n_layers, prod.model.n_heads, prod.model.n_kv_heads) == (768, 12, 12, 2)
    nsa = prod.model.nsa
    assert (nsa.l, nsa.d, nsa.lp, nsa.n, nsa.w, nsa.cmp_phi) == (32, 16, 64, 16, 512, "avg")
    t = prod.train
    assert (t.seq_len, t.global_batch, t.accumulate, t.lr, t.warmup, t.steps) == (2048, 2, 2, 2e-4, 2000, 50000)
    assert load_config("cpu_tiny").model.n_layers > 0 and load_config("cpu_small").model.d_model == 384


def test_overrides_and_paths(tmp_path):
    cfg = load_config("cpu_tiny", ["model.n_layers=2", "model.nsa.branches=slc,win", "train.lr=3e-4"])
    assert cfg.model.n_layers == 2 and cfg.model.nsa.branches == ("slc", "win") and cfg.train.lr == 3e-4
    path = tmp_path / "mine.yaml"
    path.write_text("model:\n  n_layers: 3\n")
    assert load_config(str(path)).model.n_layers == 3
    # round trip through a dict
    assert load_config(None, []).to_dict() == to_dict(load_config(None, []))


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["model.nonsense=1"], "unknown key 'model.nonsense'"),
        (["model.n_layers=two"], "model.n_layers must be an integer"),
        (["model.nsa.d=5"], "must divide model.nsa.l"),
        (["model.nsa.lp=40", "model.nsa.d=16"], "must divide model.nsa.lp"),
        (["model.nsa.n=2"], "model.nsa.n must be >= 3"),
        (["model.n_kv_heads=5"], "divisible by model.n_kv_heads"),
        (["model.nsa.cmp_phi=max"], "model.nsa.cmp_phi"),
        (["model.nsa.compressed_kernel=flash"], "model.nsa.compressed_kernel is 'flash'"),
        (
            ["model.nsa.compressed_kernel=cudnn", "model.dtype=bfloat16", "model.v_head_dim=16"],
            "needs model.head_dim = model.v_head_dim",
        ),
        (["model.nsa.compressed_kernel=cudnn"], "needs model.dtype=bfloat16 (cuDNN's fused attention takes 16-bit"),
        (["model.nsa.branches=slc,foo"], "model.nsa.branches"),
        (["model.nsa.scorer=peak"], "model.nsa.scorer is 'peak'; it must be one of 'cmp', 'minmax', 'mix'"),
        (["model.nsa.scorer_sub=16"], "scorer cmp has none: set it to 0 or model.nsa.scorer=minmax"),
        (["model.nsa.scorer=minmax", "model.nsa.scorer_sub=24"], "scorer_sub (24) must divide model.nsa.lp"),
        (["model.nsa.scorer=minmax", "model.nsa.scorer_sub=-1"], "model.nsa.scorer_sub must be >= 0"),
        (["model.nsa.scorer=minmax", "train.scorer_distill=0.1"], "does not read them: set train.scorer_distill=0"),
        (["model.nsa.scorer_candidates=32"], "the rescore scorer's first stage; scorer cmp has none"),
        (["model.nsa.scorer=rescore", "model.nsa.scorer_candidates=2"], "must be at least model.nsa.n"),
        (["parallel.overlap_reduce=true", "parallel.strategy=fsdp"], "under parallel.strategy=dp or zero1 with model"),
        (["model.dtype=float16"], "model.dtype"),
        (["train.global_batch=0"], "train.global_batch must be positive"),
        (["nosection"], "section.key=value"),
        # Retired options name the retirement and its evidence; moved schedules their new key.
        (["model.nsa.slc_straight_through=false"], "model.nsa.slc_straight_through was retired"),
        (["model.nsa.slc_warmup_steps=100"], "docs/EXPERIMENTS.md#retired-options"),
        (["model.nsa.gate_zero_kernel=true"], "model.nsa.gate_zero_kernel was retired"),
        (["model.nsa.cmp_phi=mlp_norm"], "model.nsa.cmp_phi=mlp_norm was retired"),
        (["model.nsa.cmp_phi=avg_mlp"], "docs/EXPERIMENTS.md#retired-options"),
        (["model.nsa.slc_dense_warmup_steps=5"], "model.nsa.slc_dense_warmup_steps is now train.dense_selection_steps"),
        (["model.nsa.slc_score_distill=1"], "is now train.scorer_distill "),
        (["model.nsa.slc_score_distill_steps=5"], "is now train.scorer_distill_steps"),
        (["train.scorer_distill=-1"], "train.scorer_distill must be >= 0"),
        (["train.decay_steps=-1"], "train.decay_steps must lie in [0, train.steps - max(train.warmup, 1)]"),
        (["train.steps=100", "train.warmup=30", "train.decay_steps=71"], "= [0, 70], got 71"),
        (["train.steps=20", "train.warmup=30", "train.decay_steps=1"], "= [0, -10], got 1"),
        (["data.needle_answer_weight=0"], "data.needle_answer_weight must be positive"),
        (["train.dense_selection_steps=5", "parallel.strategy=pmap"], "needs a strategy other than"),
    ],
)
def test_bad_config_is_one_clear_error(overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config("cpu_tiny", overrides)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "overrides,said",
    [
        (["train.step=3"], "unknown key 'train.step' (did you mean 'train.steps'?); valid keys in 'train' are: "),
        (["modle.d_model=64"], "unknown key 'modle' (did you mean 'model'?)"),
        (["model.nsa.lp2=32"], "unknown key 'model.nsa.lp2' (did you mean 'model.nsa.lp'?)"),
        # No close spelling in the section: the key of that name in another one.
        (["train.dtype=float32"], "unknown key 'train.dtype' (did you mean 'model.dtype'?)"),
        (["model.attention_impl=xla"], "(did you mean 'model.nsa.attention_impl'?)"),
        (["train.zzz=1"], "unknown key 'train.zzz'; valid keys in 'train' are: "),
    ],
)
def test_an_unknown_key_names_the_nearest_valid_one(overrides, said):
    with pytest.raises(ConfigError) as err:
        load_config("cpu_tiny", overrides)
    assert said in str(err.value) and "\n" not in str(err.value)


def test_a_config_name_close_to_a_shipped_one_is_suggested():
    with pytest.raises(ConfigError) as err:
        load_config("cpu_tiy")
    assert "no config named 'cpu_tiy' (did you mean 'cpu_tiny'?); choose one of: a100_pcie, " in str(err.value)


@pytest.mark.parametrize(
    "text,said",
    [
        (
            "model:\n  d_model: 64\n  n_layers: [2\ntrain:\n  steps: 3\n",
            "line 4, column 6: not valid YAML: expected ','",
        ),
        ("model:\n  d_model: 64\n n_layers: 2\n", "line 3, column 2: not valid YAML: expected <block end>"),
        (
            "model:\n\td_model: 64\n",
            "line 2, column 1: not valid YAML: found character '\\t' that cannot start any token",
        ),
        ("model: {d_model: 64\ntrain: x\n", "(while parsing a flow mapping at line 1, column 8); fix the file"),
    ],
)
def test_a_yaml_syntax_error_names_the_file_line_and_column_in_one_line(tmp_path, text, said):
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    message = str(err.value)
    assert message.startswith(f"config: {path} line ") and said in message and "\n" not in message


def test_a_run_shorter_than_its_warmup_loads_with_the_decay_off():
    t = load_config("cpu_tiny", ["train.steps=5", "train.warmup=30"]).train
    assert (t.steps, t.warmup, t.decay_steps) == (5, 30, 0)


def test_retired_key_in_a_yaml_file_is_one_error(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("model:\n  nsa:\n    slc_warmup_steps: 0\n")
    with pytest.raises(ConfigError, match=r"^config: model.nsa.slc_warmup_steps was retired; remove it") as err:
        load_config(str(path))
    assert "\n" not in str(err.value)


def test_saved_configs_of_earlier_versions_upgrade(tmp_path):
    # A checkpoint's config lists every key: retired ones at "off" are dropped, schedules move
    # to train; a retired option that was on still fails with its one line.
    saved = to_dict(load_config("cpu_tiny"))
    for key in ("dense_selection_steps", "scorer_distill", "scorer_distill_steps"):
        del saved["train"][key]
    saved["model"]["nsa"].update(slc_straight_through=False, slc_warmup_steps=0, gate_zero_kernel=False)
    saved["model"]["nsa"].update(slc_dense_warmup_steps=7, slc_score_distill=0.5, slc_score_distill_steps=3)
    cfg = config_from_dict(saved)
    assert (cfg.train.dense_selection_steps, cfg.train.scorer_distill, cfg.train.scorer_distill_steps) == (7, 0.5, 3)
    assert "slc_warmup_steps" in saved["model"]["nsa"]  # the caller's dict is left alone
    saved["model"]["nsa"]["slc_straight_through"] = True
    with pytest.raises(ConfigError, match="slc_straight_through was retired"):
        config_from_dict(saved)
    # A model directory's config.yaml of an earlier version (launch.generate reads it with saved=True).
    saved["model"]["nsa"]["slc_straight_through"] = False
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(saved))
    assert load_config(str(path), saved=True).train.dense_selection_steps == 7
    with pytest.raises(ConfigError, match="was retired; remove it"):
        load_config(str(path))


def test_resume_allows_a_changed_schedule_but_not_a_changed_model():
    # The training schedules are train keys (like train.warmup), so changing them does not block a
    # resume; model keys that define the function do. An old checkpoint's config, with the
    # retired options at "off" and the schedules under model.nsa, resumes as today's.
    saved = load_config("cpu_tiny")
    sched = ["train.dense_selection_steps=100", "train.scorer_distill=1.0", "train.scorer_distill_steps=100"]
    blocking, other = resume_conflicts(to_dict(saved), load_config("cpu_tiny", sched))
    assert blocking == [] and len(other) == 3, (blocking, other)
    assert resume_conflicts(to_dict(saved), load_config("cpu_tiny", ["model.nsa.n=5"]))[0]
    old = to_dict(saved)
    old["model"]["nsa"].update(slc_warmup_steps=0, slc_straight_through=False, gate_zero_kernel=False)
    old["model"]["nsa"].update(slc_dense_warmup_steps=0, slc_score_distill=0.0, slc_score_distill_steps=0)
    for key in ("dense_selection_steps", "scorer_distill", "scorer_distill_steps"):
        del old["train"][key]
    assert resume_conflicts(old, saved) == ([], [])


def test_resume_allows_a_changed_scan_unroll_but_not_unstacked_layers():
    # scan_unroll keeps the parameters stacked [L, ...]: a checkpoint written before the key
    # existed (or with another value) resumes; scan_layers=false stores layer_i trees: refused.
    saved = to_dict(load_config("cpu_tiny"))
    del saved["model"]["scan_unroll"]
    blocking, other = resume_conflicts(saved, load_config("cpu_tiny", ["model.scan_unroll=2"]))
    assert blocking == [] and other == ["model.scan_unroll <absent> -> 2"], (blocking, other)
    blocking, _ = resume_conflicts(saved, load_config("cpu_tiny", ["model.scan_layers=false"]))
    assert blocking == ["model.scan_layers True -> False"], blocking
    with pytest.raises(ConfigError, match="model.scan_unroll must be in 1"):
        load_config("cpu_tiny", ["model.scan_unroll=0"])


def test_unknown_config_name():
    with pytest.raises(ConfigError, match="choose one of"):
        load_config("no_such_config")


def _expected_params(m) -> int:
    """The production model's count, from the architecture (independent of flax)."""
    D, H, K, Dk, Dv, F, V, L = (
        m.d_model,
        m.n_heads,
        m.n_kv_heads,
        m.head_dim,
        m.v_head_dim,
        m.d_ff,
        m.vocab_size,
        m.n_layers,
    )
    a = m.nsa
    proj = D * H * Dk + 3 * (D * K * Dk + D * K * Dv) + H * Dv * D
    gates = D * a.gate_hidden + a.gate_hidden + a.gate_hidden * 3 * H + 3 * H
    h = a.cmp_mlp_hidden
    mlp_phi = sum(a.l * dim + a.l * dim * h + h + h * dim for dim in (Dk, Dv))
    comp = 0 if a.cmp_phi == "avg" else mlp_phi  # mean pooling has no weights
    block = proj + gates + comp + 3 * D * F + 2 * D
    return V * D + L * block + D + (0 if m.tie_embeddings else D * V)


def test_a100_pcie_parameter_count_is_pinned():
    m = load_config("a100_pcie").model
    counts = parameter_counts(m)
    assert counts["total"] == _expected_params(m) == 78_887_856
    # The paper's MLP compressor adds 2 x (l Dk + l Dk h + h + h Dk) = 545,024 weights per layer.
    m_mlp = load_config("a100_pcie", ["model.nsa.cmp_phi=mlp"]).model
    assert parameter_counts(m_mlp)["total"] == _expected_params(m_mlp) == 85_428_144
    assert counts["mlp"] == 12 * 3 * 768 * 2048


def test_keys_per_query_matches_the_papers_decode_budget():
    m = load_config("a100_pcie").model
    k = keys_per_query(m, 65536)
    # Mean over positions stays below the per-step bound T_cmp + n*lp + w (5632 at 64k).
    assert k["nsa_total"] < 4095 + 16 * 64 + 512
    assert k["dense"] == pytest.approx((65536 + 1) / 2)


def test_learning_options_names_what_is_on():
    assert learning_options(load_config("cpu_tiny")) == ""
    cfg = load_config(
        "cpu_tiny", ["train.dense_selection_steps=500", "model.nsa.gate_bias_init=-2,2,-2", "model.nsa.n=5"]
    )
    assert learning_options(cfg) == "gate_bias_init=-2.0,2.0,-2.0 dense_selection_steps=500"
    assert "nsa learning options: gate_bias_init=-2.0,2.0,-2.0 dense_selection_steps=500" in describe(cfg)


def test_the_nsa_line_names_the_block_scorer():
    assert " scorer=cmp attention_impl=" in describe(load_config("cpu_tiny"))
    cfg = load_config("cpu_tiny", ["model.nsa.scorer=minmax", "model.nsa.scorer_sub=16"])
    assert " scorer=minmax/16 attention_impl=" in describe(cfg)


def test_info_on_a_model_folder_of_a_dense_model_says_it_is_dense(tmp_path, capsys):
    """--config FOLDER reads its config.yaml; a dense model has no NSA lines and no NSA-vs-dense table."""
    from launch.info import main as info
    from nsa_jax.config import to_dict

    cfg = load_config("cpu_tiny", ["model.attention=dense", "model.dense_window=48"])
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    assert info(["--config", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "attention: dense (model.attention=dense): causal softmax attention, a sliding window of 48 keys" in out
    assert "nsa:" not in out and "keys read per query" not in out
    assert "nsa:" in describe(load_config("cpu_tiny")) and "keys read per query" in describe(load_config("cpu_tiny"))


@pytest.mark.slow
def test_info_cli():
    out = subprocess.run(
        [sys.executable, "-m", "launch.info", "--config", "a100_pcie"], capture_output=True, text=True, check=True
    )
    assert "78,887,856" in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "launch.info", "--config", "cpu_tiny", "--set", "model.nsa.n=1"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and bad.stderr.startswith("error: config: model.nsa.n")


@pytest.mark.parametrize("name", ["a100_pcie_256k", "cpu_tiny"])
def test_info_names_the_configs_own_length_and_context_degree(name):
    raw = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())  # the file itself, not the loader
    T, C = raw["train"]["seq_len"], raw.get("parallel", {}).get("context", 1)
    text = describe(load_config(name, []))
    assert f"sequence: T={T:,} (train.seq_len), parallel.context={C} " in text
    assert (f"split over {C} devices, {T // C:,} tokens each" in text) == (C > 1)


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_config_loads(path):
    cfg = load_config(path.stem, [])
    assert cfg.train.seq_len > 0


def test_the_8b_config_has_llama_31_8b_shape_with_nsa_branches():
    """configs/llama8b_64k.yaml: Llama-3.1-8B's shape (32 layers, d 4096, 32 heads over 8 of 128, d_ff 14,336,
    vocab 128,256, untied) with NSA's three K/V projections and gates; its parameter count by hand."""
    cfg = load_config("llama8b_64k", [])
    m = cfg.model
    d, H, K, Dh, F, V, L = 4096, 32, 8, 128, 14336, 128256, 32
    assert (m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff, m.vocab_size, m.n_layers) == (d, H, K, Dh, F, V, L)
    gh = m.nsa.gate_hidden
    per_layer = d * H * Dh + 3 * 2 * d * K * Dh + H * Dh * d + (d * gh + gh + gh * 3 * H + 3 * H) + 3 * d * F + 2 * d
    total = L * per_layer + 2 * V * d + d
    assert f"parameters: {total:,} total" in describe(cfg)
    assert (cfg.parallel.strategy, cfg.parallel.context, cfg.train.seq_len) == ("fsdp", 8, 65536)
