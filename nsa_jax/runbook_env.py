"""The torch runbooks' environment variables (`NSA_*`, docs/RUNBOOK.md) as config overrides.

`env_overrides(os.environ)` -> (dotted overrides, {variable: what it set}); launch.train
applies them between the YAML file and its flags, launch.stages for the stages it starts.
A bad value is one ConfigError line naming the variable. No jax.
"""

from __future__ import annotations

from nsa_jax.config import ConfigError, resolve_path

# variable -> (config key, value converter)
_NUMERIC_ENV = {
    "NSA_ACCUM": ("train.accumulate", int),
    "NSA_LR": ("train.lr", float),
    "NSA_SEQ_LEN": ("train.seq_len", int),
    "NSA_BATCH_SIZE": ("train.global_batch", int),
    "NSA_DDP_BUCKET_MB": ("parallel.bucket_mb", float),
    # The torch process-group timeout: here a step that does not end in time ends the process.
    "NSA_PG_TIMEOUT_MIN": ("ops.stall_seconds", lambda raw: float(raw) * 60),
    "NSA_MEM_DUMP_EVERY": ("logging.mem_dump_every", int),
}
_DISABLE_ENV = {
    "NSA_TB_DISABLE": "logging.tensorboard",
    "NSA_DISABLE_CSV_LOGS": "logging.csv",
    "NSA_DISABLE_AUX_STATS": "logging.aux_stats",
}


def config_from_env(environ: dict[str, str]) -> str | None:
    """The runbooks' `CONFIG=configs/x.yaml` (the config where no --config is given), or None when unset;
    a ConfigError line naming the variable when it names no config."""
    raw = environ.get("CONFIG", "").strip()
    if not raw:
        return None
    try:
        resolve_path(raw)
    except ConfigError as e:
        raise ConfigError(f"CONFIG={raw} (environment) names no config: {str(e).removeprefix('config: ')}") from None
    return raw


def env_overrides(environ: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """Runbook variables -> (dotted overrides, {variable: what it set}); ConfigError on bad values."""
    overrides, applied = [], {}

    def add(var: str, key: str, value) -> None:
        overrides.append(f"{key}={value}")
        applied[var] = f"{key}={value}"

    for var, (key, conv) in _NUMERIC_ENV.items():
        raw = environ.get(var, "").strip()
        if raw:
            try:
                add(var, key, conv(raw))
            except ValueError:
                kind = "an integer" if conv is int else "a number"
                raise ConfigError(f"{var}={raw!r} must be {kind} ({key})") from None
    raw = environ.get("NSA_DDP_COMPRESS", "").strip().lower()
    if raw:
        dtypes = {"bf16": "bfloat16", "bfloat16": "bfloat16", "off": "float32", "fp32": "float32", "none": "float32"}
        if raw not in dtypes:
            raise ConfigError(f"NSA_DDP_COMPRESS={raw!r} must be bf16 or off")
        add("NSA_DDP_COMPRESS", "parallel.grad_reduce_dtype", dtypes[raw])
    for var, key in _DISABLE_ENV.items():
        raw = environ.get(var, "").strip()
        if raw:
            if raw not in ("0", "1"):
                raise ConfigError(f"{var}={raw!r} must be 1 (disable) or 0 (enable)")
            add(var, key, "false" if raw == "1" else "true")
    return overrides, applied
