"""Per-layer NSA decode caches (the decode step that reads them: nsa_jax/inference/decode.py).

Owns the fixed-size cache pytree, its sizes for a maximum length, and its map to the model's `cache`
variable collection (`NSACache.variables()` / `NSACache.from_variables`), which NSAAttention reads and
writes in prefill and decode mode (the slot arithmetic, `ring_positions` / `compressed_visible`, lives in
nsa_jax/nsa/decode.py). Every array has a leading layer axis L (the scanned layers) and a batch axis B;
each row carries its own position, so rows of different lengths share one cache. Per layer and row:
  * `kslc/vslc` [S, K, D]: raw selection keys/values of every position < S (S = max length rounded up to
    a multiple of lp, so a selected block is never cut by the end of the buffer);
  * `kwin/vwin` [R, K, D]: ring buffer of the window keys/values, R = min(w, S); slot s holds the latest
    position p <= t with p = s (mod R), so the ring holds exactly [max(0, t - w + 1), t] once t is written;
  * `ktail/vtail` [l, K, D]: ring buffer of the raw (RoPE'd) compression keys/values of the last l
    positions: the not-yet-complete compression block(s) the next compressed token is built from;
  * `kcmp/vcmp` [Tc, K, D]: compressed keys/values; entry i is written when block i completes, at
    t = i*d + l - 1, and read only from then on;
  * `kmin/kmax` [U, K, Dk]: under the `minmax` and `mix` scorers (kernels/scorers.py), each sub-block's channel-wise
    minima and maxima of the selection keys, U = S / sub, grown key by key as the sub-block fills (read
    only once its block is complete); no slots under the other scorers;
  * `pos` [B]: tokens already in the cache = the position of the next token.
Under dense attention (model.attention=dense, nsa/dense.py) only the ring is used: R is the dense window,
or S with none, and the other arrays have no slots. Entries beyond a row's position may hold stale values
(a right-padded prefill); they are overwritten before any query can see them, and every read masks by position.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from nsa_jax.config import ModelConfig
from nsa_jax.kernels.scorers import KEY_SCORERS, scorer_sub
from nsa_jax.kernels.xla import num_compressed
from nsa_jax.nsa.decode import CACHE_NAMES, compressed_visible, ring_positions

__all__ = ["CacheSizes", "NSACache", "cache_sizes", "compressed_visible", "init_cache", "ring_positions"]


@dataclasses.dataclass(frozen=True)
class CacheSizes:
    """Static sizes of one cache: S raw slots, R window slots, Tc compressed slots, l tail slots."""

    S: int
    R: int
    Tc: int
    l: int
    max_len: int
    raw: bool = True  # the selection branch's S raw slots are allocated (not under dense attention)
    U: int = 0  # the minmax scorer's sub-block bounds (0 under the other scorers)


def cache_sizes(cfg: ModelConfig, max_len: int) -> CacheSizes:
    a = cfg.nsa
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    S = -(-max_len // a.lp) * a.lp
    # At least one compressed slot so shapes stay non-empty; it is never visible
    # before a block completes, and none completes when S < l.
    Tc = max(1, num_compressed(S, a.l, a.d))
    if cfg.attention == "dense":  # the ring alone (nsa/dense.py): as long as the window or the cache
        # (global layers among local ones, model.global_every: the cache's, each local layer masking to its window)
        window = 0 if cfg.global_every else cfg.dense_window
        return CacheSizes(S=S, R=min(window or S, S), Tc=0, l=0, max_len=max_len, raw=False)
    U = S // scorer_sub(a) if a.scorer in KEY_SCORERS else 0
    # Local layers (model.global_every) read the ring too, over their own window.
    R = min(max(a.w, cfg.dense_window if cfg.global_every else 0), S)
    return CacheSizes(S=S, R=R, Tc=Tc, l=a.l, max_len=max_len, U=U)


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
    kmin_LxBxUxKxDk: jax.Array
    kmax_LxBxUxKxDk: jax.Array
    pos_B: jax.Array

    def variables(self) -> dict:
        """The model's `cache` collection: {"pos": [B], "layers": {"attn": {name: [L, B, ...]}}}."""
        arrays = {name: getattr(self, f) for name, f in zip(CACHE_NAMES, _FIELDS)}
        return {"pos": self.pos_B, "layers": {"attn": arrays}}

    @classmethod
    def from_variables(cls, variables: dict) -> "NSACache":
        attn = variables["layers"]["attn"]
        return cls(**{f: attn[name] for name, f in zip(CACHE_NAMES, _FIELDS)}, pos_B=variables["pos"])


# NSACache fields in the order of the layer's CACHE_NAMES.
_FIELDS = (
    "kslc_LxBxSxKxDk",
    "vslc_LxBxSxKxDv",
    "kwin_LxBxRxKxDk",
    "vwin_LxBxRxKxDv",
    "ktail_LxBxlxKxDk",
    "vtail_LxBxlxKxDv",
    "kcmp_LxBxTcxKxDk",
    "vcmp_LxBxTcxKxDv",
    "kmin_LxBxUxKxDk",
    "kmax_LxBxUxKxDk",
)


def init_cache(cfg: ModelConfig, batch: int, max_len: int) -> NSACache:
    """An empty cache (all zeros, every row at position 0)."""
    z = cache_sizes(cfg, max_len)
    L, K, Dk, Dv = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, cfg.v_head_dim
    dt = jnp.dtype(cfg.dtype)

    def zeros(n, D):
        return jnp.zeros((L, batch, n, K, D), dt)

    return NSACache(
        kslc_LxBxSxKxDk=zeros(z.S if z.raw else 0, Dk),
        vslc_LxBxSxKxDv=zeros(z.S if z.raw else 0, Dv),
        kwin_LxBxRxKxDk=zeros(z.R, Dk),
        vwin_LxBxRxKxDv=zeros(z.R, Dv),
        ktail_LxBxlxKxDk=zeros(z.l, Dk),
        vtail_LxBxlxKxDv=zeros(z.l, Dv),
        kcmp_LxBxTcxKxDk=zeros(z.Tc, Dk),
        vcmp_LxBxTcxKxDv=zeros(z.Tc, Dv),
        kmin_LxBxUxKxDk=zeros(z.U, Dk),
        kmax_LxBxUxKxDk=zeros(z.U, Dk),
        pos_B=jnp.zeros((batch,), jnp.int32),
    )
