"""The window and compressed branches (and dense causal attention) on a TPU: jax's splash attention.

Both branches are dense attention under a mask that splash attention (jax.experimental.pallas.ops.tpu,
the Pallas TPU kernels MaxText trains with) computes inside its kernels and uses to skip whole tiles:
* window: query t sees keys (t - w, t] (`LocalMask`; with a window at least the sequence, `CausalMask`),
  so the work is O(T w) where the XLA path's query chunks each read a slab of C + w - 1 keys;
* compressed: query t sees compressed token i iff i d + l - 1 <= t (`CompressedMask`, below), the
  attention alone: the `cmp` scorer's block scores need the probabilities, which splash never forms,
  so a plan that scores with cmp keeps the compressed branch on XLA (kernels/plan.py).
Splash takes [heads, T, D] per sequence with the G query heads of a KV head adjacent (the project's
head order) and no scale: q is scaled before the call and the batch is a vmap. Its masks are static, so
a query offset is a number baked into the mask: under context parallelism, where a device's offset is
traced (its index on the `seq` axis), `lax.switch` picks among one kernel per offset the layout allows
(`offsets`: every chunk's first position, 2 C of them). The
sequence is padded to whole tiles; a padded key is never visible to a real query, and a padded query's
row is cut away (its cotangent is 0, so it adds nothing to dK / dV). Forward and backward are splash's
own (its custom VJP: dQ and dK/dV kernels over the same mask).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

from nsa_jax.kernels.pallas_common import pad_axis

# Query and key tile: splash's tiles are multiples of 128 lanes; 512 is MaxText's default for its
# forward and backward, and a sequence shorter than a tile runs one tile of its own (rounded to 128).
TILE = 512
LANES = 128


class CompressedMask(masks._ComputableMask):
    """NSA's compressed-branch mask: query row r, at position t = r + offset, sees compressed token i iff
    i * stride + length - 1 <= t (the token's last key is at or before t)."""

    def __init__(self, shape: tuple[int, int], length: int, stride: int, offset: int = 0):
        self.length, self.stride, self.offset = length, stride, offset
        super().__init__(
            shape=shape, mask_function=lambda q_ids, kv_ids: kv_ids * stride + (length - 1) <= q_ids + offset
        )

    def _key(self) -> tuple:
        return (self.shape, self.length, self.stride, self.offset)

    def __eq__(self, other: object):
        if not isinstance(other, type(self)):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self):
        return hash((type(self), *self._key()))


def _tiles(n: int) -> tuple[int, int]:
    """(padded length, tile) for a sequence of n: whole TILEs, or one tile of n rounded up to 128."""
    if n <= TILE:
        padded = -(-n // LANES) * LANES
        return padded, padded
    return -(-n // TILE) * TILE, TILE


def _kernel(mask_kind: tuple, heads: int, tq: int, bq: int, tk: int, bkv: int, interpret: bool, offset: int = 0):
    """A splash kernel for one mask over `heads` query heads, query row r at position r + `offset`. Its block
    tables are numpy work at trace time, which splash caches per mask (the masks hash by their parameters);
    the kernel object itself holds them as arrays of the trace that builds it, so it is built per call,
    never kept."""
    kind, *args = mask_kind
    if kind == "causal":
        mask = masks.CausalMask((tq, tk), offset=offset)
    elif kind == "local":
        mask = masks.LocalMask((tq, tk), window_size=(args[0] - 1, 0), offset=offset)
    else:
        mask = CompressedMask((tq, tk), *args, offset=offset)
    sizes = splash.BlockSizes(
        block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq, block_kv_dkv=bkv,
        block_kv_dkv_compute=bkv, block_q_dq=bq, block_kv_dq=bkv,
    )  # fmt: skip
    return splash.make_splash_mha(
        masks.MultiHeadMask([mask] * heads), block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
    )


def tiles_visited(mask_kind: tuple, q_len: int, kv_len: int) -> tuple[int, int, int]:
    """(tiles the forward visits, all tiles, the key tile) of one head under `mask_kind` (``("local", w)``,
    ``("causal",)`` or ``("compressed", l, d)``): splash skips a tile its mask leaves empty."""
    tq, bq = _tiles(q_len)
    tk, bkv = _tiles(kv_len)
    # The table's kv axis may be shrunk to the most tiles any query tile visits: the grid is counted whole.
    block_mask = np.asarray(_kernel(mask_kind, 1, tq, bq, tk, bkv, True).fwd_mask_info.block_mask)
    return int(np.count_nonzero(block_mask[0])), (tq // bq) * (tk // bkv), bkv


def _at_precision(fn, precision: str):
    """`fn` with its forward and its backward traced at `precision`: splash's dots take jax's default
    matmul precision when they are traced, and its backward is traced when the gradient is taken,
    outside any context around the call. The forward's vjp closure (a pytree of the residuals)
    travels to the backward as its residual. `fn` closes over no traced value: the splash kernel,
    whose block tables are arrays of the trace that builds it, is an argument (within a `lax.switch`
    branch, _at_offset, the branch's values are gone by the time the backward is traced)."""

    @jax.custom_vjp
    def run(*xs):
        with jax.default_matmul_precision(precision):
            return fn(*xs)

    def fwd(*xs):
        with jax.default_matmul_precision(precision):
            return jax.vjp(fn, *xs)

    def bwd(vjp, do):
        with jax.default_matmul_precision(precision):
            return vjp(do)

    run.defvjp(fwd, bwd)
    return run


def _attend(mask_kind, q_BxTxHxDk, k_BxSxKxDk, v_BxSxKxDv, scale, interpret, offset: int = 0):
    """Splash attention of q over k, v under `mask_kind`, query row r at position r + `offset` (static):
    o [B, T, H, Dv] in q's dtype."""
    B, T, H, Dk = q_BxTxHxDk.shape
    S, K = k_BxSxKxDk.shape[1], k_BxSxKxDk.shape[2]
    if H % K:
        raise ValueError(f"splash attention: {H} query heads are not a multiple of {K} KV heads")
    scale = Dk**-0.5 if scale is None else float(scale)
    tq, bq = _tiles(T)
    tk, bkv = _tiles(S)
    kernel = _kernel(mask_kind, H, tq, bq, tk, bkv, bool(interpret), offset)
    # Scaled in fp32, rounded once to q's dtype: splash's scores are q . k as given.
    q = (q_BxTxHxDk.astype(jnp.float32) * scale).astype(q_BxTxHxDk.dtype)
    q_BxHxTxD = pad_axis(q, 1, tq).transpose(0, 2, 1, 3)
    k_BxKxSxD = pad_axis(k_BxSxKxDk, 1, tk).transpose(0, 2, 1, 3)
    v_BxKxSxD = pad_axis(v_BxSxKxDv, 1, tk).transpose(0, 2, 1, 3)
    # Mosaic refuses an fp32 contract precision for 16-bit operands (which jax_default_matmul_precision=highest
    # would ask of splash's dots); fp32 operands keep it.
    precision = "highest" if q.dtype == jnp.float32 else "default"
    attend = lambda kernel, q, k, v: jax.vmap(kernel)(q, k, v)  # noqa: E731
    o_BxHxTxD = _at_precision(attend, precision)(kernel, q_BxHxTxD, k_BxKxSxD, v_BxKxSxD)
    return o_BxHxTxD.transpose(0, 2, 1, 3)[:, :T].astype(q_BxTxHxDk.dtype)


def _at_offset(run, q_offset, offsets: tuple[int, ...] | None):
    """run(offset) at a query offset: a number runs one kernel; a traced one (context parallelism)
    `lax.switch`es among one kernel per candidate in `offsets`, the positions it can take (NaNs at any other)."""
    if isinstance(q_offset, (int, np.integer)):
        return run(int(q_offset))
    if not offsets:
        raise ValueError("splash attention at a traced query offset needs the offsets it can take (offsets=...)")
    listed = jnp.asarray(offsets, jnp.int32) == q_offset
    # An offset not listed gets NaNs, which the step's non-finite check stops at, never another offset's mask.
    branch = jnp.where(listed.any(), jnp.argmax(listed), len(offsets))
    out = jax.eval_shape(lambda: run(offsets[0]))
    unlisted = lambda: jnp.full(out.shape, jnp.nan, out.dtype)  # noqa: E731
    return jax.lax.switch(branch, [*(lambda off=off: run(off) for off in offsets), unlisted])


def window_attention_splash(
    q_BxTxHxDk, k_BxTxKxDk, v_BxTxKxDv, window: int, scale=None, *, q_offset=0, offsets=None, interpret=False
):
    """Sliding-window attention (window_attention_xla's contract) through splash attention: query row r at
    t = r + q_offset sees keys max(0, t - window + 1) .. t; a window at least the keys is causal
    attention. A traced `q_offset` must be one of `offsets` (_at_offset)."""
    T = k_BxTxKxDk.shape[1]
    kind = ("causal",) if window >= _tiles(T)[0] else ("local", int(window))
    attend = lambda off: _attend(kind, q_BxTxHxDk, k_BxTxKxDk, v_BxTxKxDv, scale, interpret, off)  # noqa: E731
    return _at_offset(attend, q_offset, offsets)


def compressed_attention_splash(
    q_BxTxHxDk, kc_BxTcxKxDk, vc_BxTcxKxDv, *, l: int, d: int, scale=None, q_offset=0, offsets=None, interpret=False
):
    """The compressed branch's attention alone (compressed_attention's contract with scores=False): query
    row r at t = r + q_offset sees compressed token i iff i d + l - 1 <= t; a query that sees none
    (t < l - 1) gets 0. A traced `q_offset` must be one of `offsets` (_at_offset)."""
    T = q_BxTxHxDk.shape[1]

    def attend(off: int):
        o = _attend(("compressed", int(l), int(d)), q_BxTxHxDk, kc_BxTcxKxDk, vc_BxTcxKxDv, scale, interpret, off)
        sees_T = np.arange(T) + off >= l - 1
        return jnp.where(sees_T[None, :, None, None], o, jnp.zeros((), o.dtype))

    return _at_offset(attend, q_offset, offsets)
