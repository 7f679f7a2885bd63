"""Per-layer NSA decode caches (the decode step that reads them: nsa_jax/inference/decode.py).

Owns the fixed-size cache pytree, its sizes for a maximum length, the slot
arithmetic of its ring buffers, and filling it from a prefill forward pass.
Every array has a leading layer axis L (the model's scanned layers) and a batch
axis B; each row carries its own position, so rows of different lengths share
one cache.

Per layer and row:
  * `kslc/vslc` [S, K, D]: raw selection keys/values of every position < S
    (S = max length rounded up to a multiple of lp, so a selected block is
    never cut by the end of the buffer).
  * `kwin/vwin` [R, K, D]: ring buffer of the window keys/values, R = min(w, S);
    slot s holds the latest position p <= t with p = s (mod R), so the ring
    holds exactly [max(0, t - w + 1), t] once position t is written.
  * `ktail/vtail` [l, K, D]: ring buffer of the raw (RoPE'd) compression
    keys/values of the last l positions: the not-yet-complete compression
    block(s) that the next compressed token is built from.
  * `kcmp/vcmp` [Tc, K, D]: compressed keys/values; entry i is written when
    block i completes, at t = i*d + l - 1, and read only from then on.
  * `pos` [B]: tokens already in the cache = the position of the next token.

Entries beyond a row's position may hold stale values (a right-padded
prefill); they are overwritten before any query can see them, and every read
masks by position.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from nsa_jax.config import ModelConfig
from nsa_jax.layers import rope
from nsa_jax.nsa.selection import num_compressed


@dataclasses.dataclass(frozen=True)
class CacheSizes:
    """Static sizes of one cache: S raw slots, R window slots, Tc compressed slots, l tail slots."""

    S: int
    R: int
    Tc: int
    l: int
    max_len: int


def cache_sizes(cfg: ModelConfig, max_len: int) -> CacheSizes:
    a = cfg.nsa
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    S = -(-max_len // a.lp) * a.lp
    # At least one compressed slot so shapes stay non-empty; it is never visible
    # before a block completes, and none completes when S < l.
    Tc = max(1, num_compressed(S, a.l, a.d))
    return CacheSizes(S=S, R=min(a.w, S), Tc=Tc, l=a.l, max_len=max_len)


@flax.struct.dataclass
class NSACache:
    kslc_LxBxSxKxDk: jax.Array
    vslc_LxBxSxKxDv: jax.Array
    kwin_LxBxRxKxDk: jax.Array
    vwin_LxBxRxKxDv: jax.Array
    ktail_LxBxlxKxDk: jax.Array
    vtail_LxBxlxKxDv: jax.Array
    kcmp_LxBxTcxKxDk: jax.Array
    vcmp_LxBxTcxKxDv: jax.Array
    pos_B: jax.Array

    @property
    def max_len(self) -> int:
        return self.kslc_LxBxSxKxDk.shape[2]


def init_cache(cfg: ModelConfig, batch: int, max_len: int) -> NSACache:
    """An empty cache (all zeros, every row at position 0)."""
    z = cache_sizes(cfg, max_len)
    L, K, Dk, Dv = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, cfg.v_head_dim
    dt = jnp.dtype(cfg.dtype)

    def zeros(n, D):
        return jnp.zeros((L, batch, n, K, D), dt)

    return NSACache(
        kslc_LxBxSxKxDk=zeros(z.S, Dk),
        vslc_LxBxSxKxDv=zeros(z.S, Dv),
        kwin_LxBxRxKxDk=zeros(z.R, Dk),
        vwin_LxBxRxKxDv=zeros(z.R, Dv),
        ktail_LxBxlxKxDk=zeros(z.l, Dk),
        vtail_LxBxlxKxDv=zeros(z.l, Dv),
        kcmp_LxBxTcxKxDk=zeros(z.Tc, Dk),
        vcmp_LxBxTcxKxDv=zeros(z.Tc, Dv),
        pos_B=jnp.zeros((batch,), jnp.int32),
    )


def ring_positions(last_B: jax.Array, size: int) -> jax.Array:
    """[B, size]: the position held by each ring slot once positions <= last are written.

    Slot s holds p = last - ((last - s) mod size), the latest p <= last with
    p = s (mod size); p < 0 means the slot was never written.
    """
    s = jnp.arange(size, dtype=jnp.int32)
    last = last_B.astype(jnp.int32)[:, None]
    return last - jnp.mod(last - s[None, :], size)


def compressed_visible(t_B: jax.Array, Tc: int, l: int, d: int) -> jax.Array:
    """[B, Tc]: compressed token i is visible to query t iff its block ended: i*d + l - 1 <= t."""
    end_Tc = jnp.arange(Tc, dtype=jnp.int32) * d + l - 1
    return end_Tc[None, :] <= t_B[:, None]


def _gather_rows(x_LxBxTxKxD: jax.Array, pos_BxN: jax.Array) -> jax.Array:
    """x[:, b, pos[b, j]] -> [L, B, N, K, D], zero where pos < 0."""
    valid = pos_BxN >= 0
    idx = jnp.maximum(pos_BxN, 0)
    g = jax.vmap(lambda xb, ib: xb[:, ib], in_axes=(1, 0), out_axes=1)(x_LxBxTxKxD, idx)
    return jnp.where(valid[None, :, :, None, None], g, jnp.zeros((), g.dtype))


def fill_from_prefill(
    cfg: ModelConfig,
    captured: dict,
    lengths_B: jax.Array,
    max_len: int,
) -> NSACache:
    """A cache holding the first lengths[b] positions of row b.

    `captured` holds the model forward's own projections of a right-padded
    prompt [B, P]: the per-branch K/V Dense outputs `k_cmp`..`v_win`
    ([L, B, P, K*D], before RoPE) and the compressor outputs `cmp_k`/`cmp_v`
    ([L, B, Tc(P), K, D]).
    """
    a = cfg.nsa
    z = cache_sizes(cfg, max_len)
    L, B, P = captured["k_slc"].shape[:3]
    K = cfg.n_kv_heads
    if P > z.S:
        raise ValueError(f"prompt length {P} exceeds the cache length {z.S}")
    pos_P = jnp.arange(P, dtype=jnp.int32)
    lengths_B = lengths_B.astype(jnp.int32)

    def heads(name, roped):
        x = captured[name]
        x = x.reshape(L * B, P, K, x.shape[-1] // K)
        if roped:
            x = rope(x, pos_P, cfg.rope_theta)
        return x.reshape(L, B, P, K, x.shape[-1])

    kslc, vslc = heads("k_slc", True), heads("v_slc", False)
    kwin, vwin = heads("k_win", True), heads("v_win", False)
    kraw, vraw = heads("k_cmp", True), heads("v_cmp", False)

    # Raw selection K/V: positions >= length are padding, zeroed, then the buffer grows to S.
    live = (pos_P[None, :] < lengths_B[:, None])[None, :, :, None, None]

    def full(x):
        x = jnp.where(live, x, jnp.zeros((), x.dtype))
        return jnp.pad(x, [(0, 0), (0, 0), (0, z.S - P), (0, 0), (0, 0)])

    win_pos = ring_positions(lengths_B - 1, z.R)
    tail_pos = ring_positions(lengths_B - 1, z.l)

    def compressed(name):
        x = captured[name]  # [L, B, Tc(P), K, D]
        Tp = min(x.shape[2], z.Tc)
        x = x[:, :, :Tp]
        done = compressed_visible(lengths_B - 1, Tp, a.l, a.d)[None, :, :, None, None]
        x = jnp.where(done, x, jnp.zeros((), x.dtype))
        return jnp.pad(x, [(0, 0), (0, 0), (0, z.Tc - Tp), (0, 0), (0, 0)])

    dt = jnp.dtype(cfg.dtype)
    return NSACache(
        kslc_LxBxSxKxDk=full(kslc).astype(dt),
        vslc_LxBxSxKxDv=full(vslc).astype(dt),
        kwin_LxBxRxKxDk=_gather_rows(kwin, win_pos).astype(dt),
        vwin_LxBxRxKxDv=_gather_rows(vwin, win_pos).astype(dt),
        ktail_LxBxlxKxDk=_gather_rows(kraw, tail_pos).astype(dt),
        vtail_LxBxlxKxDv=_gather_rows(vraw, tail_pos).astype(dt),
        kcmp_LxBxTcxKxDk=compressed("cmp_k").astype(dt),
        vcmp_LxBxTcxKxDv=compressed("cmp_v").astype(dt),
        pos_B=lengths_B,
    )
