"""A model folder: a model's config and parameters without a run around them.

    <folder>/config.yaml      Config.to_dict() (the model, and the tokenizer it reads text with)
    <folder>/params.msgpack   the parameters (flax.serialization msgpack of host numpy arrays)

launch.convert writes one from a pretrained checkpoint (with tokenizer.json beside it);
launch.generate and launch.evaluate read one as `--ckpt FOLDER`; `train.init_from: FOLDER`
starts a fresh run from its parameters (a resume restores the run's own checkpoint;
resume.check_init_from checks the folder before jax starts).
"""

from __future__ import annotations

import pathlib

import flax.serialization
import jax
import numpy as np
import yaml

from nsa_jax.config import ConfigError
from nsa_jax.rundir.files import MODEL_CONFIG_FILE as CONFIG_FILE
from nsa_jax.rundir.files import MODEL_PARAMS_FILE as PARAMS_FILE


def is_model_dir(path: str | pathlib.Path) -> bool:
    return (pathlib.Path(path) / PARAMS_FILE).is_file()


def write_model_dir(path: str | pathlib.Path, cfg, params) -> None:
    """Writes `cfg` (a Config) and `params` into folder `path` (made if missing)."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_FILE).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    host = jax.tree.map(np.asarray, params)
    (path / PARAMS_FILE).write_bytes(flax.serialization.msgpack_serialize(host))


def read_params(path: str | pathlib.Path) -> dict:
    """The parameters of model folder `path` (host numpy arrays)."""
    params = flax.serialization.msgpack_restore((pathlib.Path(path) / PARAMS_FILE).read_bytes())
    return params["params"] if set(params) == {"params"} else params


def mismatched_leaf(params: dict, want) -> str | None:
    """The first leaf of `params` missing from, or shaped unlike, `want` (a tree of shapes or arrays); None."""
    have = {jax.tree_util.keystr(k): np.shape(v) for k, v in jax.tree_util.tree_leaves_with_path(params)}
    need = {jax.tree_util.keystr(k): tuple(v.shape) for k, v in jax.tree_util.tree_leaves_with_path(want)}
    for key, shape in need.items():
        if key not in have:
            return f"{key} is missing"
        if tuple(have[key]) != shape:
            return f"{key} has shape {list(have[key])}, the config's model needs {list(shape)}"
    extra = sorted(set(have) - set(need))
    return f"{extra[0]} is not a parameter of the config's model" if extra else None


def initial_params(cfg) -> dict | None:
    """train.init_from's parameters in the layout of cfg.model (scanned or per layer), checked against
    its shapes (ConfigError naming the first mismatch); None without train.init_from."""
    if not cfg.train.init_from:
        return None
    from nsa_jax.info import param_shapes  # noqa: PLC0415 - traces the model: only when a run starts from a folder

    params = read_params(cfg.train.init_from)
    if not cfg.model.scan_layers and "layers" in params:
        stacked = params.pop("layers")
        for i in range(cfg.model.n_layers):
            params[f"layer_{i}"] = jax.tree.map(lambda x, i=i: x[i], stacked)
    problem = mismatched_leaf(params, param_shapes(cfg.model))
    if problem:
        raise ConfigError(f"config: train.init_from {cfg.train.init_from}: {problem}")
    return params
