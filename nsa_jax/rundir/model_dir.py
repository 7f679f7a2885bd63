"""A model folder: a model's config and parameters without a run around them.

    <folder>/config.yaml          Config.to_dict() (the model, and the tokenizer it reads text with)
    <folder>/params.safetensors   the parameters, fp32, named by their path ("layers.attn.q.kernel");
                                  an earlier version's params.msgpack (flax.serialization) still reads

The safetensors layout (an 8-byte header length, a JSON header of dtype, shape and byte range
per array, then the raw arrays) is written one array at a time and read memory-mapped, so
neither side holds a second copy of the model. launch.convert writes a folder from a
pretrained checkpoint (with tokenizer.json beside it); launch.generate and launch.evaluate
read one as `--ckpt FOLDER`; `train.init_from: FOLDER` starts a fresh run from its
parameters (a resume restores the run's own checkpoint; resume.check_init_from checks the
folder before jax starts).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import struct

import jax
import numpy as np
import yaml

from nsa_jax.config import ConfigError, load_config
from nsa_jax.rundir.checkpoint import load_for_inference
from nsa_jax.rundir.files import MODEL_CONFIG_FILE as CONFIG_FILE
from nsa_jax.rundir.files import MODEL_PARAMS_FILE as PARAMS_FILE
from nsa_jax.rundir.files import MODEL_PARAMS_FILES, folder_tokenizer

SEP = "."
DTYPES = {"F32": np.float32, "I32": np.int32}


def is_model_dir(path: str | pathlib.Path) -> bool:
    return any((pathlib.Path(path) / name).is_file() for name in MODEL_PARAMS_FILES)


def _flat(params: dict, prefix: str = ""):
    for key, value in params.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}{SEP}")
        else:
            yield f"{prefix}{key}", value


def write_model_dir(path: str | pathlib.Path, cfg, params) -> None:
    """Writes `cfg` (a Config) and `params` (fp32) into folder `path` (made if missing), one array at a time."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_FILE).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    arrays = [(name, np.asarray(x, np.float32)) for name, x in _flat(params)]
    header, offset = {}, 0
    for name, x in arrays:
        header[name] = {"dtype": "F32", "shape": list(x.shape), "data_offsets": [offset, offset + x.nbytes]}
        offset += x.nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)  # the arrays start 8-byte aligned
    with open(path / PARAMS_FILE, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for _, x in arrays:
            f.write(np.ascontiguousarray(x).data)


def read_params(path: str | pathlib.Path) -> dict:
    """The parameters of model folder `path`: memory-mapped numpy arrays (msgpack: read whole)."""
    path = pathlib.Path(path)
    file = path / PARAMS_FILE
    if not file.is_file():
        import flax.serialization  # noqa: PLC0415 - only an earlier version's folder needs it

        params = flax.serialization.msgpack_restore((path / MODEL_PARAMS_FILES[1]).read_bytes())
        return params["params"] if set(params) == {"params"} else params
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    params: dict = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        x = np.memmap(file, dtype=DTYPES[info["dtype"]], mode="r", offset=8 + n + begin, shape=tuple(info["shape"]))
        node = params
        *parents, leaf = name.split(SEP)
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = x
    return params


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


def read_config(path: str | pathlib.Path, overrides: list[str] | tuple[str, ...] = ()):
    """A model folder's Config. config.yaml names the tokenizer by the path it was written at; a
    folder moved or copied elsewhere reads its own copy beside it when that path is gone."""
    cfg = load_config(str(pathlib.Path(path) / CONFIG_FILE), overrides, saved=True)
    name = folder_tokenizer(path, cfg.data.tokenizer)
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=name))


def load_model(path: str | pathlib.Path):
    """(Config, params) of a model folder or of the newest readable checkpoint at `path` (an out_dir,
    its checkpoints/, or one step)."""
    if is_model_dir(path):
        return read_config(path), read_params(path)
    return load_for_inference(path)
