"""Cross-field checks of a run configuration: `validate(cfg)` raises ConfigError with the first problem.

Owns the rules no single key's type states (a divisor, a range, a strategy that runs under
a context degree), and the sets of valid names the checks hold a config to. The schema
(the dataclasses, their types and defaults) is config.py's; nothing here imports it or jax,
so config.py imports these checks and the shell validates before the backend starts.
"""

from __future__ import annotations

import re

from nsa_jax.config_text import ConfigError
from nsa_jax.seq_layout import split_problem

# The NSA branches, in the order of the gate's outputs (the run files name their columns after them).
BRANCHES = ("cmp", "slc", "win")
# Long-context suites (nsa_jax/evaluation, `python -m launch.evaluate`).
EVAL_SUITES = ("needle", "loss-by-position", "kv_recall")
# The strategies whose step splits a sequence over `seq` (step/strategies.make_mapped_grad_fn).
CONTEXT_STRATEGIES = ("dp", "zero1", "fsdp")


def validate(cfg):
    """`cfg` (a config.Config) if it passes every cross-field check; else ConfigError with the first problem."""
    m, a, t = cfg.model, cfg.model.nsa, cfg.train

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ConfigError(f"config: {msg}")

    for key in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "v_head_dim", "d_ff"):
        need(getattr(m, key) > 0, f"model.{key} must be positive, got {getattr(m, key)}")
    need(
        m.n_heads % m.n_kv_heads == 0,
        f"model.n_heads ({m.n_heads}) must be divisible by model.n_kv_heads ({m.n_kv_heads})",
    )
    need(m.head_dim % 2 == 0, f"model.head_dim must be even for RoPE, got {m.head_dim}")
    for key in ("l", "d", "lp", "n", "w", "cmp_mlp_hidden", "gate_hidden", "query_chunk"):
        need(getattr(a, key) > 0, f"model.nsa.{key} must be positive, got {getattr(a, key)}")
    need(a.l % a.d == 0, f"model.nsa.d ({a.d}) must divide model.nsa.l ({a.l})")
    need(a.lp % a.d == 0, f"model.nsa.d ({a.d}) must divide model.nsa.lp ({a.lp})")
    need(a.n >= 3, f"model.nsa.n must be >= 3 (block 0, the current and the previous block are forced), got {a.n}")
    need(len(a.branches) > 0, "model.nsa.branches must name at least one of cmp, slc, win")
    for b in a.branches:
        need(b in BRANCHES, f"model.nsa.branches has {b!r}; use a subset of cmp, slc, win")
    need(len(set(a.branches)) == len(a.branches), f"model.nsa.branches repeats a branch: {list(a.branches)}")
    need(
        len(a.gate_bias_init) in (0, 3),
        f"model.nsa.gate_bias_init must be empty or three numbers [cmp, slc, win], got {list(a.gate_bias_init)}",
    )
    need(
        1 <= m.scan_unroll <= m.n_layers,
        f"model.scan_unroll must be in 1..model.n_layers ({m.n_layers}), got {m.scan_unroll}",
    )
    need(m.norm_eps > 0, f"model.norm_eps must be positive, got {m.norm_eps}")
    check_family(m, need)
    check_scorer(m, t, need)
    need(
        a.compressed_kernel != "cudnn" or m.head_dim == m.v_head_dim,
        f"model.nsa.compressed_kernel=cudnn needs model.head_dim = model.v_head_dim (cuDNN's fused attention), "
        f"got {m.head_dim} and {m.v_head_dim}; use compressed_kernel=auto",
    )
    need(
        a.compressed_kernel != "cudnn" or (m.head_dim <= 128 and m.head_dim % 8 == 0),
        f"model.nsa.compressed_kernel=cudnn needs model.head_dim <= 128 and a multiple of 8 (cuDNN's fused "
        f"attention on an A100), got {m.head_dim}; use compressed_kernel=auto",
    )
    need(
        a.compressed_kernel != "cudnn" or m.dtype == "bfloat16",
        f"model.nsa.compressed_kernel=cudnn needs model.dtype=bfloat16 (cuDNN's fused attention takes 16-bit "
        f"inputs), got {m.dtype}; use compressed_kernel=auto",
    )

    check_train(cfg, need)
    need(
        cfg.data.needle_answer_weight > 0,
        f"data.needle_answer_weight must be positive (1: the key weighs as text), got {cfg.data.needle_answer_weight}",
    )
    need(0.0 <= cfg.data.val_fraction < 1.0, f"data.val_fraction must lie in [0, 1), got {cfg.data.val_fraction}")
    need(cfg.parallel.bucket_mb > 0, f"parallel.bucket_mb must be positive, got {cfg.parallel.bucket_mb}")
    need(
        not cfg.parallel.overlap_reduce or (cfg.parallel.strategy in ("dp", "zero1") and m.scan_layers),
        f"parallel.overlap_reduce reduces each scanned layer's gradients under parallel.strategy=dp or zero1 with "
        f"model.scan_layers (got {cfg.parallel.strategy}, scan_layers={m.scan_layers}); fsdp reduce-scatters per "
        "layer already: set parallel.strategy=dp or zero1, or parallel.overlap_reduce=false",
    )
    n_dev = cfg.parallel.num_devices
    need(n_dev >= 0, f"parallel.num_devices must be >= 0 (0 = all devices), got {n_dev}")
    check_context(cfg, need)
    check_run(cfg, need)
    return cfg


def check_train(cfg, need) -> None:
    """The train section: counts, the LR schedule, the selection's learning options."""
    m, t = cfg.model, cfg.train
    for key in ("seq_len", "global_batch", "accumulate", "steps", "log_every", "eval_every", "eval_batches"):
        need(getattr(t, key) > 0, f"train.{key} must be positive, got {getattr(t, key)}")
    need(t.warmup >= 0, f"train.warmup must be >= 0, got {t.warmup}")
    most = t.steps - max(t.warmup, 1)  # updates after the one at the peak
    need(
        t.decay_steps == 0 or 0 < t.decay_steps <= most,  # 0 (off) also where the run ends inside the warm-up
        f"train.decay_steps must lie in [0, train.steps - max(train.warmup, 1)] = [0, {most}], got {t.decay_steps}",
    )
    need(t.scorer_distill >= 0, f"train.scorer_distill must be >= 0 (0 disables it), got {t.scorer_distill}")
    need(
        not (t.scorer_distill and m.attn_softcap),
        "train.scorer_distill with model.attn_softcap: the distillation's target is uncapped attention; "
        "set train.scorer_distill=0",
    )
    need(t.rope_positions >= 0, f"train.rope_positions must be >= 0 (0 disables it), got {t.rope_positions}")
    need(
        t.loss_chunk >= 0,
        f"train.loss_chunk must be >= 0 (positions per chunk of the loss; 0: all), got {t.loss_chunk}",
    )
    for key in ("dense_selection_steps", "scorer_distill_steps"):
        need(getattr(t, key) >= 0, f"train.{key} must be >= 0 (0: see docs/NSA.md), got {getattr(t, key)}")
    for key in ("dense_selection_steps", "scorer_distill_steps"):
        need(
            not (getattr(t, key) and cfg.parallel.strategy == "pmap"),
            f"train.{key} needs a strategy other than parallel.strategy=pmap (dp, gspmd, zero1, fsdp)",
        )
    need(
        m.attention == "nsa" or not (t.scorer_distill or t.dense_selection_steps),
        "train.scorer_distill and train.dense_selection_steps train NSA's selection, which "
        "model.attention=dense does not have: set both to 0",
    )
    need(t.lr > 0, f"train.lr must be positive, got {t.lr}")
    need(0 <= t.min_lr <= t.lr, f"train.min_lr must lie in [0, train.lr], got {t.min_lr}")
    need(t.grad_clip >= 0, f"train.grad_clip must be >= 0 (0 disables clipping), got {t.grad_clip}")


def check_run(cfg, need) -> None:
    """What surrounds training: checkpoints, evaluation suites, logging, the watchdogs."""
    need(cfg.checkpoint.save_every > 0, f"checkpoint.save_every must be positive, got {cfg.checkpoint.save_every}")
    need(
        cfg.checkpoint.save_minutes >= 0,
        f"checkpoint.save_minutes must be >= 0 (0: save by steps only), got {cfg.checkpoint.save_minutes}",
    )
    need(cfg.checkpoint.max_to_keep > 0, f"checkpoint.max_to_keep must be positive, got {cfg.checkpoint.max_to_keep}")
    e = cfg.eval
    for name in e.suites:
        need(name in EVAL_SUITES, f"eval.suites has {name!r}; use a subset of {', '.join(EVAL_SUITES)}")
    need(all(L > 0 for L in e.lengths), f"eval.lengths must be positive, got {list(e.lengths)}")
    need(all(0 <= d <= 1 for d in e.depths) and e.depths, f"eval.depths must lie in [0, 1], got {list(e.depths)}")
    need(e.samples > 0 and e.rows > 0, f"eval.samples and eval.rows must be positive, got {e.samples}, {e.rows}")
    o = cfg.ops
    need(o.stall_seconds >= 0, f"ops.stall_seconds must be >= 0 (0 disables the watchdog), got {o.stall_seconds}")
    need(o.max_skips >= 0, f"ops.max_skips must be >= 0 (0 = never halt on skips), got {o.max_skips}")
    need(
        o.init_timeout_s > 0 and o.peer_timeout_s > 0,
        f"ops.init_timeout_s and ops.peer_timeout_s must be positive, got {o.init_timeout_s}, {o.peer_timeout_s}",
    )
    need(
        cfg.logging.mem_dump_every >= 0,
        f"logging.mem_dump_every must be >= 0 (0: none), got {cfg.logging.mem_dump_every}",
    )
    window = profile_window(cfg.logging.profile_steps)
    need(
        window is not False,
        f"logging.profile_steps must be A:B or A-B, the first and last optimizer step to trace (e.g. 10-12), "
        f"got {cfg.logging.profile_steps!r}",
    )
    if window:
        a, b = window
        need(
            1 <= a <= b <= cfg.train.steps,
            f"logging.profile_steps {a}:{b} lies outside the run's steps 1..{cfg.train.steps}: "
            f"pick 1 <= A <= B <= train.steps",
        )


def profile_window(text: str) -> tuple[int, int] | None | bool:
    """logging.profile_steps "A:B" or "A-B" -> (A, B); "" -> None; anything else -> False. (Unquoted in
    YAML, 10:12 reads as a base-60 number: quote it or write 10-12.)"""
    if not str(text).strip():
        return None
    m = re.fullmatch(r"\s*(\d+)\s*[:-]\s*(\d+)\s*", str(text))
    return (int(m.group(1)), int(m.group(2))) if m else False


def check_scorer(m, t, need) -> None:
    """The selection branch's block scorer (kernels/scorers.py): its sub-block, what trains it."""
    a = m.nsa
    need(a.scorer_sub >= 0, f"model.nsa.scorer_sub must be >= 0 (0: one bound a block of lp), got {a.scorer_sub}")
    need(
        a.scorer_sub == 0 or a.scorer in ("minmax", "mix"),
        f"model.nsa.scorer_sub ({a.scorer_sub}) is the minmax bound's sub-block; scorer {a.scorer} has none: "
        "set it to 0 or model.nsa.scorer=minmax",
    )
    need(
        a.scorer_sub == 0 or a.lp % a.scorer_sub == 0,
        f"model.nsa.scorer_sub ({a.scorer_sub}) must divide model.nsa.lp ({a.lp})",
    )
    need(
        not t.scorer_distill or a.scorer in ("cmp", "rescore"),
        f"train.scorer_distill trains the cmp scorer's compressed keys; model.nsa.scorer={a.scorer} does not "
        "read them: set train.scorer_distill=0 or model.nsa.scorer=cmp",
    )
    need(
        a.scorer_candidates == 0 or a.scorer == "rescore",
        f"model.nsa.scorer_candidates ({a.scorer_candidates}) is the rescore scorer's first stage; scorer "
        f"{a.scorer} has none: set it to 0 or model.nsa.scorer=rescore",
    )
    need(
        a.scorer_candidates == 0 or a.scorer_candidates >= a.n,
        f"model.nsa.scorer_candidates ({a.scorer_candidates}) must be at least model.nsa.n ({a.n}) (0: 4 n)",
    )


def check_family(m, need) -> None:
    """What a pretrained model brings (docs/PRETRAINED.md): a dense window, RoPE scaling, Gemma's features."""
    need(m.dense_window >= 0, f"model.dense_window must be >= 0 (0: every key before the query), got {m.dense_window}")
    need(
        m.dense_window == 0 or m.attention == "dense" or m.global_every > 0,
        f"model.dense_window ({m.dense_window}) is for model.attention=dense, or NSA's local layers "
        "(model.global_every); NSA's window is model.nsa.w",
    )
    r = m.rope_scaling
    if r.kind == "llama3":
        need(r.factor >= 1, f"model.rope_scaling.factor must be >= 1, got {r.factor}")
        need(
            0 < r.low_freq_factor < r.high_freq_factor,
            f"model.rope_scaling needs 0 < low_freq_factor < high_freq_factor, got {r.low_freq_factor}, "
            f"{r.high_freq_factor}",
        )
        need(r.original_max_len > 0, f"model.rope_scaling.original_max_len must be positive, got {r.original_max_len}")
    if r.kind == "linear":
        need(r.factor > 0, f"model.rope_scaling.factor must be positive, got {r.factor}")
    for key in ("query_scale", "attn_softcap", "final_softcap", "local_rope_theta"):
        need(getattr(m, key) >= 0, f"model.{key} must be >= 0 (0: off), got {getattr(m, key)}")
    need(
        m.attn_softcap == 0 or m.attention == "dense" or m.nsa.scorer not in ("mix", "rescore"),
        f"model.attn_softcap ({m.attn_softcap}) with model.nsa.scorer={m.nsa.scorer}: its scores are raw where "
        "the attention's are capped; use scorer cmp or minmax",
    )
    need(m.global_every >= 0, f"model.global_every must be >= 0 (0: every layer alike), got {m.global_every}")
    need(
        m.global_every == 0 or m.attention == "dense" or "win" in m.nsa.branches,
        f"model.global_every ({m.global_every}): NSA's local layers attend through the window branch; "
        "add win to model.nsa.branches",
    )
    need(
        m.global_every == 0 or m.dense_window > 0,
        f"model.global_every ({m.global_every}) needs model.dense_window, the local layers' window",
    )
    need(
        m.local_rope_theta == 0 or m.global_every > 0,
        "model.local_rope_theta is the local layers' RoPE base: set model.global_every too",
    )


def check_context(cfg, need) -> None:
    """parallel.context: a positive degree, on the strategy and the model that run under it, with a
    sequence long enough for its chunks (nsa/context.py)."""
    C, a = cfg.parallel.context, cfg.model.nsa
    need(C >= 1, f"parallel.context must be >= 1 (1: no context parallelism), got {C}")
    if C == 1:
        return
    need(
        cfg.model.global_every == 0,
        f"parallel.context={C} with model.global_every (local and global layers) is not supported yet: "
        "set parallel.context=1",
    )
    need(
        cfg.parallel.strategy in CONTEXT_STRATEGIES,
        f"parallel.context={C} runs with parallel.strategy=dp, zero1 or fsdp (their shard_map step); "
        f"got {cfg.parallel.strategy}: set parallel.strategy=dp or parallel.context=1",
    )
    need(
        cfg.model.attention == "nsa",
        f"parallel.context={C} splits NSA's branches; model.attention=dense runs with parallel.context=1",
    )
    need(
        not cfg.train.scorer_distill,
        f"parallel.context={C}: train.scorer_distill's dense target is not split over devices; "
        "set train.scorer_distill=0 or parallel.context=1",
    )
    need(
        a.compressed_kernel != "cudnn",
        f"parallel.context={C}: the compressed branch through cuDNN takes no query offset; "
        "set model.nsa.compressed_kernel=auto (its flash kernels) or parallel.context=1",
    )
    problem = split_problem(cfg.train.seq_len, C, a.l, a.lp)
    need(problem is None, problem or "")
