"""Typed run configuration: YAML files -> frozen dataclasses, validated at load time.

Owns the schema of every config key, the lookup of `--config NAME` (a file in
`configs/` or a path), and the validation that turns bad input into one
`ConfigError` line naming the key and the fix (an unknown key with the nearest
valid one). Reading the YAML text and the dotted `--set section.key=value` items
is config_text.py; the runbook variables (`NSA_*`) become overrides in
runbook_env.py. Nothing here imports jax: the shell can validate before the
backend starts.

Dimension letters used across the project (declared once, here):
  B batch, T sequence length, D model width, V vocabulary, F MLP hidden width,
  H query heads, K key/value heads (GQA groups), G = H // K query heads per KV head,
  Dk / Dv head dims, L layers, Tc compressed tokens, Nb selection blocks, N selected blocks.
"""

from __future__ import annotations

import copy
import dataclasses
import pathlib
import types
import typing
from typing import Any, Literal

# The valid names the checks hold a config to, read by the rest of the project from here.
from nsa_jax.config_checks import BRANCHES, CONTEXT_STRATEGIES, EVAL_SUITES, validate  # noqa: F401

# ConfigError is defined with the text it is first raised on; callers import it from here.
from nsa_jax.config_text import ConfigError, apply_overrides, closest, read_yaml

CONFIG_DIR = pathlib.Path(__file__).resolve().parent.parent / "configs"


# Options that are gone (the evidence: docs/EXPERIMENTS.md "Retired options"): key -> its "off"
# value, which configs saved before the retirement hold (upgrade_saved drops it there).
RETIRED = {
    "model.nsa.slc_straight_through": False,
    "model.nsa.slc_warmup_steps": 0,
    "model.nsa.gate_zero_kernel": False,
}
RETIRED_VALUES = {"model.nsa.cmp_phi": ("mlp_norm", "avg_mlp")}
RETIRED_DOC = "docs/EXPERIMENTS.md#retired-options"
# Training schedules that were model keys: old key -> new key.
MOVED = {
    "model.nsa.slc_dense_warmup_steps": "train.dense_selection_steps",
    "model.nsa.slc_score_distill": "train.scorer_distill",
    "model.nsa.slc_score_distill_steps": "train.scorer_distill_steps",
}


@dataclasses.dataclass(frozen=True)
class NSAConfig:
    """Native Sparse Attention hyper-parameters (docs/NSA.md "Shapes")."""

    l: int = 32  # compression block length
    d: int = 16  # compression stride; must divide l and lp
    lp: int = 64  # selection block length (the paper's l')
    n: int = 16  # selected blocks per query, the 3 forced ones included
    w: int = 512  # sliding window
    cmp_phi: Literal["mlp", "avg"] = "avg"  # block -> one key/value map (docs/NSA.md)
    cmp_mlp_hidden: int = 128  # hidden width of the mlp phi (weights shared across heads)
    gate_hidden: int = 64  # hidden width of the gate MLP
    # Initial bias of the last gate Dense per branch [cmp, slc, win] (sigmoid(b) is the start gate;
    # docs/NSA.md "Learning options"); empty: zero biases, every gate starts near 0.5.
    gate_bias_init: tuple[float, ...] = ()
    # Branches whose output enters the gated sum; others are dropped (ablations).
    # Selection still scores blocks with the compressed keys when cmp is off.
    branches: tuple[str, ...] = BRANCHES
    # Selection and window kernels: auto = pallas on GPU, xla elsewhere.
    attention_impl: Literal["auto", "pallas", "xla"] = "auto"
    # The selection branch's Pallas kernel: auto = the one measured fastest at the run's T
    # (kernels/plan.py plan_kernels; docs/PERFORMANCE.md), or one named (kernels.SELECTION_KERNELS).
    selection_kernel: Literal["auto", "blocksparse", "gather"] = "auto"
    # The compressed branch's attention where Pallas runs: auto = pallas (its flash kernels), or
    # cudnn (cuDNN's fused attention over the regrouped branch and a Pallas log-sum-exp pass for
    # block scoring; kernels/plan.py, docs/PERFORMANCE.md).
    compressed_kernel: Literal["auto", "pallas", "cudnn"] = "auto"
    # Query chunk of the XLA path: bounds the live memory of every branch.
    query_chunk: int = 512
    # How the selection branch ranks its blocks (kernels/scorers.py; docs/NSA.md "Block scorers"):
    # cmp (the paper's Eq. 9-10: the compressed probabilities summed over each block), minmax
    # (Quest's bound on q . k from each sub-block's channel-wise key minima and maxima, a block's
    # largest: keeps a block's peak), mix (the two scores added) or rescore (cmp's best
    # scorer_candidates blocks, re-ranked by each head's exact attention mass over their keys).
    scorer: Literal["cmp", "minmax", "mix", "rescore"] = "cmp"
    # minmax, mix: the sub-block length of the bound (divides lp); 0: lp, one bound a block.
    scorer_sub: int = 0
    # rescore: the blocks cmp hands the exact second stage (>= n); 0: 4 n.
    scorer_candidates: int = 0


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequencies rescaled by wavelength band, as a pretrained model was trained (docs/PRETRAINED.md)."""

    # none: theta ** (-2i / Dk) as they are; linear: all divided by `factor` (Gemma 3's global layers)
    kind: Literal["none", "llama3", "linear"] = "none"
    factor: float = 1.0  # long wavelengths are divided by it
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192  # the context the bands are measured against


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder-only LM shape and numerics."""

    vocab_size: int = 256
    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 12
    n_kv_heads: int = 2
    head_dim: int = 64  # Dk
    v_head_dim: int = 64  # Dv
    d_ff: int = 2048  # the gated MLP's hidden width F
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    # Compute dtype of matmuls; params are always fp32, softmax and loss fp32.
    dtype: Literal["float32", "bfloat16"] = "float32"
    # Activation rematerialisation per block: none, full (recompute the block), dots
    # (save matmul outputs only).
    remat: Literal["none", "full", "dots"] = "none"
    scan_layers: bool = True
    # Layers per iteration of the training layer scan (its `unroll`); the parameters stay
    # stacked [L, ...] whatever it is. n_layers: no loop left in the program.
    scan_unroll: int = 1
    init_std: float = 0.02
    # Each layer's attention: nsa (three branches and their gates), or dense (plain causal
    # attention: a pretrained model as it was imported, launch.convert --attention dense).
    attention: Literal["nsa", "dense"] = "nsa"
    dense_window: int = 0  # dense only: each query sees this many keys (Mistral); 0: all before it
    qkv_bias: bool = False  # biases on the query, key and value projections (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head's query and key before RoPE (Qwen3)
    rope_scaling: RopeScaling = dataclasses.field(default_factory=RopeScaling)
    # Gemma 2/3's features (docs/PRETRAINED.md). Every RMSNorm scales by (1 + weight):
    norm_plus_one: bool = False
    embed_scale: bool = False  # the embedding's output times sqrt(d_model)
    mlp_act: Literal["silu", "gelu_tanh"] = "silu"  # the gated MLP: SwiGLU (silu) or GeGLU (gelu, tanh form)
    post_norms: bool = False  # an RMSNorm on the attention's and on the MLP's output before each residual add
    query_scale: float = 0.0  # scores scaled by query_scale ** -0.5 (query_pre_attn_scalar); 0: head_dim's
    attn_softcap: float = 0.0  # scores -> c * tanh(scores / c) before the softmax, on XLA (Gemma 2); 0: off
    final_softcap: float = 0.0  # logits -> c * tanh(logits / c) (Gemma 2); 0: off
    # Local and global layers (dense only, with dense_window): layer i is global (sees every
    # earlier key) when (i + 1) % global_every == 0, local (dense_window keys) otherwise (Gemma 2:
    # 2, Gemma 3: 6); 0: every layer alike. local_rope_theta: the local layers' RoPE base, unscaled
    # (Gemma 3); 0: rope_theta and rope_scaling, as the global layers.
    global_every: int = 0
    local_rope_theta: float = 0.0
    nsa: NSAConfig = dataclasses.field(default_factory=NSAConfig)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation and loop cadence, counted in optimizer steps."""

    seq_len: int = 2048
    global_batch: int = 2  # sequences per micro-batch, summed over all devices
    accumulate: int = 1  # micro-batches per optimizer step
    steps: int = 50_000
    lr: float = 2e-4
    min_lr: float = 0.0
    warmup: int = 2000
    # 0: after the warm-up a cosine from lr to min_lr over the rest of train.steps. N > 0
    # (warmup-stable-decay): lr holds after the warm-up and the cosine runs over the last N
    # updates only, so a run continued to a larger train.steps (a longer stage) resumes at
    # the peak, not part-way down a cosine (step/optimizer.py learning_rate).
    decay_steps: int = 0
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    log_every: int = 20
    eval_every: int = 1000
    eval_batches: int = 4
    seed: int = 1337
    out_dir: str = "artifacts/run"
    # Training schedule of the selection branch (docs/NSA.md "Learning options"; the phases:
    # nsa_jax/step/schedule.py). Dense selection: for the first N steps every block of seq_len
    # is selected (evaluation and decode always use model.nsa.n); 0: off.
    dense_selection_steps: int = 0
    # Block-scorer distillation: adds weight * KL(dense selection attention per block ||
    # compressed block scores) to the loss; only the compressed keys learn from it; 0: off.
    scorer_distill: float = 0.0
    # Steps the distillation runs for: 0 every step; N only the first N.
    scorer_distill_steps: int = 0
    # Randomized RoPE positions: 0 (off) RoPE sees positions 0..seq_len-1; N > seq_len: every
    # micro-batch's rows sit in [0, N) as a few contiguous pieces with random gaps between
    # them (step/positions.py random_rope_positions), so a short row trains the rotary distances
    # of a row of N (docs/LONG_CONTEXT.md). Only RoPE moves: blocks, window and causality
    # stay at the token indices; evaluation uses 0..L-1.
    rope_positions: int = 0
    # A model folder (launch.convert's OUT; nsa_jax/rundir/model_dir.py) whose parameters start a
    # fresh run instead of a random initialisation; a resume restores the run's own checkpoint.
    init_from: str = ""
    # The loss's logits made this many positions at a time (model.rows_nll; forward and
    # recomputed backward), never [rows, T, vocab] at once: the largest buffers of a step at long T
    # with a large vocabulary. 0: all positions at once.
    loss_chunk: int = 0
    # Parameter names that train (any part of a parameter's path: gate_fc1, gate_fc2, k_cmp, v_cmp,
    # cmp_k/cmp_v with cmp_phi mlp, q, mlp, ...); the others stay as they are. Empty: every parameter
    # trains. It may change between the stages of one run (the optimizer state's layout is the same).
    trainable: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where tokens come from."""

    # tokenized: a folder written by `python -m launch.prepare_data` (its manifest sets the
    # train/val split, so val_fraction is not used; tokenizer must be the manifest's).
    # needle: pass-key rows over the text of data.path (nsa_jax/data/needle.py); the loss counts
    # every target, the pass key's weighted by needle_answer_weight.
    # reviews: label/text examples (Yelp Review Full's layout; nsa_jax/data/reviews.py), one a row,
    # prompt -> answer, the answer alone in the loss.
    dataset: Literal["synthetic", "fineweb_edu", "jsonl", "text", "kv_recall", "needle", "reviews", "tokenized"] = (
        "synthetic"
    )
    path: str = ""
    tokenizer: str = "byte"
    val_fraction: float = 0.01
    loader_timeout: float = 0.0  # seconds; 0 waits forever
    synthetic_on_fail: bool = False
    prefetch: int = 2
    workers: int = 0
    # kv_recall: key/value pairs written early in each row (at a random offset, or at
    # the start), and queries of them at the end of the row (each query's pair lies
    # farther back than model.nsa.w).
    kv_pairs: int = 8
    kv_queries: int = 4
    kv_placement: Literal["random", "start"] = "random"
    # kv_recall: a pair as two tokens `k v` (split) or one token standing for (k, v)
    # (fused: one attention hop retrieves it); nsa_jax/data/kv_recall.py.
    kv_format: Literal["split", "fused"] = "split"
    # kv_recall: train (and report val_loss) on the answer positions only; the rest of
    # a row is noise. false: every position, like a language-model corpus.
    kv_loss_mask: bool = True
    # needle: weight of each pass-key target in the loss (every other target weighs 1).
    needle_answer_weight: float = 20.0


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Long-context suites run with every evaluation (train.eval_every); written to long_eval.csv."""

    suites: tuple[str, ...] = ()  # of EVAL_SUITES; empty: none
    lengths: tuple[int, ...] = ()  # row lengths L; empty: train.seq_len
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)  # needle depths in [0, 1]
    samples: int = 2  # needles per L x depth cell
    rows: int = 2  # rows per L for loss-by-position and kv_recall


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How the train step is spread over devices and processes."""

    strategy: Literal["dp", "gspmd", "zero1", "fsdp", "pmap"] = "dp"
    grad_reduce_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    bucket_mb: float = 25.0  # XLA all-reduce combine threshold
    # Devices of the run: 0 = every visible device, N = the first N (N = 1 is the
    # single-device fallback of the runbooks' `--ddp 0`).
    num_devices: int = 0
    # Context parallelism: C devices share every sequence (the `seq` mesh axis; the mesh is
    # data x seq = devices/C x C; nsa_jax/nsa/context.py). 1: each device holds whole sequences.
    context: int = 1
    # dp and zero1: reduce each scanned layer's gradients as the backward leaves that layer (the
    # study's async/bucketed DDP; step/strategies.py reduce_in_backward: dp's all-reduce, zero1's
    # reduce-scatter), so the collectives can overlap the backward of the layers below, instead of
    # one reduction after the whole backward. With
    # train.accumulate > 1 each micro-batch's backward reduces (DDP without no_sync). Off until
    # a GPU measures it no slower.
    overlap_reduce: bool = False


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """Which run artifacts are written (docs/RUNBOOK.md "Artifacts")."""

    csv: bool = True
    tensorboard: bool = True
    heartbeat: bool = True
    aux_stats: bool = True
    env_json: bool = True
    # Every N optimizer steps each process writes its devices' memory profile (pprof, jax's
    # save_device_memory_profile) to <out_dir>/memory/step<N>_rank<r>.prof; 0: none (NSA_MEM_DUMP_EVERY).
    mem_dump_every: int = 0
    # "A:B" or "A-B" (quote A:B in YAML): each process traces optimizer steps A..B (jax.profiler, all its devices) into
    # <out_dir>/traces/rank<r>/; `python -m launch.trace_summary OUT_DIR` summarises them per rank.
    # "": no trace (launch.train --profile-steps A:B).
    profile_steps: str = ""


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints under <out_dir>/checkpoints (nsa_jax/rundir/checkpoint.py)."""

    save_every: int = 5000  # optimizer steps between saves; the last step is always saved
    # Also save once this much wall-clock time has passed since the last save (or the first
    # step), so a crash or a lost machine costs at most about that much work; 0: steps only.
    save_minutes: float = 30.0
    max_to_keep: int = 3  # newest checkpoints kept; older ones are deleted after a save commits
    # false: no new checkpoints (existing ones are still resumed from, never trained over).
    enabled: bool = True
    # Write files in a background thread: the loop waits only for the copy off the device.
    async_save: bool = True
    # false: resume weights, optimizer state and step but restart the data stream from its
    # beginning; for a resume whose data layout (dataset, batch, seq_len, process count)
    # changed on purpose, which otherwise stops with an error.
    restore_data: bool = True


@dataclasses.dataclass(frozen=True)
class OpsConfig:
    """Run health: watchdogs and halts (nsa_jax/ops)."""

    # In-process stall watchdog: no step ends for this long -> stack dump, a
    # `watchdog_dump` heartbeat and exit status 75, so a scheduler restarts the job
    # instead of it hanging on a stuck peer. 0 disables it. Must exceed the slowest
    # step, the first evaluation's compile and a checkpoint save included.
    stall_seconds: float = 0.0
    # A non-finite loss or gradient: halt (.anomaly_type + .HALT, exit status 1), or
    # skip the update and count it.
    nan_policy: Literal["halt", "skip"] = "halt"
    # With nan_policy=skip: halt anyway once this many updates were skipped (0 = never).
    max_skips: int = 0
    # jax.distributed, multi-process runs only: how long processes wait for each other
    # at start-up, and how long a peer may miss heartbeats before it counts as dead and
    # the others are stopped.
    init_timeout_s: int = 300
    peer_timeout_s: int = 100


@dataclasses.dataclass(frozen=True)
class Config:
    """A whole run."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    ops: OpsConfig = dataclasses.field(default_factory=OpsConfig)

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)


# ---------------------------------------------------------------------------
# dict <-> dataclass


def to_dict(obj: Any) -> Any:
    """A plain, YAML-safe dict of a config dataclass (tuples become lists)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return [to_dict(v) for v in obj]
    return obj


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Checks `value` against the annotation `tp`; returns it in canonical form."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value in RETIRED_VALUES.get(key, ()):
            raise ConfigError(f"config: {key}={value} was retired; use {_type_name(tp)} (the evidence: {RETIRED_DOC})")
        if value not in typing.get_args(tp):
            raise ConfigError(f"config: {key} is {value!r}; it must be {_type_name(tp)}")
        return value
    if origin in (tuple, list):
        (elem,) = typing.get_args(tp)[:1]
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
            if elem is int:  # "--set eval.lengths=1024,2048"
                value = [int(v) if v.lstrip("-").isdigit() else v for v in value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config: {key} must be a list, got {value!r}")
        return tuple(_coerce(v, elem, f"{key}[{i}]") for i, v in enumerate(value))
    if origin in (typing.Union, types.UnionType):
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config: {key} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config: {key} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 reads "3e-4" (no dot) as a string; accept any float literal.
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config: {key} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"config: {key} must be a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config annotation {tp!r} for {key}")


def from_dict(cls: type, data: dict[str, Any] | None, prefix: str = "") -> Any:
    """Builds dataclass `cls` from `data`, rejecting unknown keys and wrong types."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"config: section '{prefix.rstrip('.') or '<root>'}' must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    for name in unknown:
        key = f"{prefix}{name}"
        if key in RETIRED:
            raise ConfigError(f"config: {key} was retired; remove it (the evidence: {RETIRED_DOC})")
        if key in MOVED:
            raise ConfigError(f"config: {key} is now {MOVED[key]} (a training schedule); rename it")
    if unknown:
        guess = nearest_key(prefix, unknown[0], list(fields))
        hint = f" (did you mean {guess!r}?)" if guess else ""
        raise ConfigError(
            f"config: unknown key '{prefix}{unknown[0]}'{hint}; valid keys in "
            f"'{prefix.rstrip('.') or '<root>'}' are: {', '.join(fields)}"
        )
    kwargs = {}
    for name, value in data.items():
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = from_dict(tp, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, tp, f"{prefix}{name}")
    return cls(**kwargs)


def nearest_key(prefix: str, name: str, fields: list[str]) -> str | None:
    """The valid dotted key an unknown `prefix + name` most likely meant: the one key of that name in
    another section (`train.dtype` -> `model.dtype`), else the closest spelling in its section; None."""
    elsewhere = [key for key in _dotted_keys(Config) if key.rsplit(".", 1)[-1] == name]
    if len(elsewhere) == 1:  # the exact name in another section beats a near spelling in this one
        return elsewhere[0]
    close = closest(name, fields)
    return f"{prefix}{close}" if close else None


def _dotted_keys(cls: type, prefix: str = "") -> list[str]:
    out = []
    for name, tp in typing.get_type_hints(cls).items():
        out += _dotted_keys(tp, f"{prefix}{name}.") if dataclasses.is_dataclass(tp) else [f"{prefix}{name}"]
    return out


# ---------------------------------------------------------------------------
# loading


def resolve_path(name: str) -> pathlib.Path:
    """`a100_pcie` -> configs/a100_pcie.yaml; an existing path is taken as is."""
    p = pathlib.Path(name)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.is_file():
            raise ConfigError(f"config: file {name} not found; pass a YAML path or a name from {CONFIG_DIR}")
        return p
    candidate = CONFIG_DIR / f"{name}.yaml"
    if not candidate.is_file():
        names = sorted(q.stem for q in CONFIG_DIR.glob("*.yaml"))
        guess = closest(name, names)
        hint = f" (did you mean {guess!r}?)" if guess else ""
        raise ConfigError(
            f"config: no config named '{name}'{hint}; choose one of: {', '.join(names)}, or pass a YAML path"
        )
    return candidate


def load_config(name: str | None = None, overrides: list[str] | tuple[str, ...] = (), saved: bool = False) -> Config:
    """Loads, overrides and validates a config; `name=None` gives the defaults.

    `saved`: the file is one the project wrote (a model directory's config.yaml), maybe by
    an earlier version: upgrade_saved reads it in today's keys.
    """
    data: dict[str, Any] = {}
    if name is not None:
        path = resolve_path(name)
        data = read_yaml(path)
        if not isinstance(data, dict):
            raise ConfigError(f"config: {path} must hold a mapping of sections (model:, train:, ...)")
        if saved:
            data = upgrade_saved(data)
    data = apply_overrides(data, list(overrides))
    return validate(from_dict(Config, data))


def upgrade_saved(data: dict[str, Any]) -> dict[str, Any]:
    """A config dict saved by an earlier version (a checkpoint's, a run's config.yaml) in today's keys.

    Retired options at their "off" value are dropped (a saved config lists every key) and
    moved schedules take their new names; a retired option that was on stays, so loading
    it fails with the retirement's one line.
    """
    data = copy.deepcopy(data)
    for old, off in RETIRED.items():
        *path, name = old.split(".")
        node = _section(data, path)
        if node is not None and name in node and node[name] == off:
            del node[name]
    for old, new in MOVED.items():
        *path, name = old.split(".")
        node = _section(data, path)
        if node is not None and name in node:
            *new_path, new_name = new.split(".")
            target = _section(data, new_path)
            if target is not None:
                target.setdefault(new_name, node.pop(name))
    return data


def _section(data: dict[str, Any], path: list[str]) -> dict[str, Any] | None:
    for part in path:
        data = data.get(part) if isinstance(data, dict) else None
    return data if isinstance(data, dict) else None


def replace(cfg: Config, overrides: list[str] | tuple[str, ...]) -> Config:
    """A copy of `cfg` with dotted overrides applied and validated."""
    return validate(from_dict(Config, apply_overrides(to_dict(cfg), list(overrides))))
