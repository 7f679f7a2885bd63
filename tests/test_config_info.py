"""Config loading and validation, and the info command."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nsa_jax.config import ConfigError, load_config, to_dict
from nsa_jax.info import describe, keys_per_query, learning_options, parameter_counts


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
        (["model.nsa.branches=slc,foo"], "model.nsa.branches"),
        (["model.dtype=float16"], "model.dtype"),
        (["train.global_batch=0"], "train.global_batch must be positive"),
        (["nosection"], "section.key=value"),
    ],
)
def test_bad_config_is_one_clear_error(overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config("cpu_tiny", overrides)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


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
        "cpu_tiny", ["model.nsa.slc_dense_warmup_steps=500", "model.nsa.gate_bias_init=-2,2,-2", "model.nsa.n=5"]
    )
    assert learning_options(cfg) == "gate_bias_init=-2.0,2.0,-2.0 slc_dense_warmup_steps=500"
    assert "nsa learning options: gate_bias_init=-2.0,2.0,-2.0 slc_dense_warmup_steps=500" in describe(cfg)


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
