"""Context parallelism: one training sequence spread over the `seq` mesh axis (docs/NSA.md "Context parallelism").

Owns the layout of a sequence over C devices and the collectives the NSA layer needs under
it; the layer (nsa/layer.py) reads its sequence through `SeqLayout` (it reaches the layer
inside the kernel plan, `KernelPlan.layout`), and the batch record (step/rows.py) is laid
out with `SeqLayout.lay_out`. `WholeSequence` reads a sequence one device holds whole through
the same methods, so the layer has one path.

Layout (zig-zag): T tokens padded at the end to T' = 2 C S (seq_layout.py: S a multiple of
lcm(l, lp), so chunks start on a compression stride and a selection block) and cut into 2C
chunks; device i of `seq` holds chunks i and 2C-1-i, so the work that grows with the position
is the same on every device. Padding comes after every real token: no real query sees it, and
it carries no loss.

What crosses devices per layer and forward: the selection and window branches' K and V,
all-gathered (`gather`); the compressed K and V, all-gathered after each device compressed
the blocks that end in its chunks (`compress_chunks`; a block starting in the previous chunk
takes its first l - d raw tokens from there, `prev_tails`). In the backward each all-gather
becomes a reduce-scatter that returns every gathered token's gradient to its owner.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from nsa_jax.config import Config
from nsa_jax.mesh import SEQ
from nsa_jax.seq_layout import chunk_len, device_order, natural_slots


def _permute_chunks(x: jax.Array, axis: int, n_chunks: int, perm: np.ndarray) -> jax.Array:
    shape = x.shape
    x = x.reshape(*shape[:axis], n_chunks, shape[axis] // n_chunks, *shape[axis + 1 :])
    return jnp.take(x, jnp.asarray(perm), axis=axis).reshape(shape)


def to_device_order(x: jax.Array, C: int, axis: int) -> jax.Array:
    """x with its length-T' axis `axis` in device order (device i's 2S tokens contiguous, i-th of C)."""
    return _permute_chunks(x, axis, 2 * C, device_order(C))


def pad_to(x: jax.Array, length: int, axis: int, value=0) -> jax.Array:
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


@dataclasses.dataclass(frozen=True)
class SeqLayout:
    """One device's part of a sequence split over the `seq` axis; its methods run inside shard_map.

    context: C (devices on the axis); chunk: S (tokens per chunk, 2 chunks per device);
    real_len: T, the tokens before the padding (T' = 2 C S >= T).
    The layer reads a sequence through `pieces`, `gather` and `compress`, the methods it
    shares with WholeSequence (one device, the whole sequence).
    """

    context: int
    chunk: int
    real_len: int
    axis: str = SEQ

    @property
    def seq_len(self) -> int:
        """T' = 2 C S: the padded length every device's positions and gathered keys span."""
        return 2 * self.context * self.chunk

    def lay_out(self, x: jax.Array, axis: int, value=0) -> jax.Array:
        """Outside shard_map: x with its length-T axis `axis` padded to T' (with `value`) and in device
        order, ready to be split over `seq` (device i's 2S tokens are the i-th run of 2S)."""
        return to_device_order(pad_to(x, self.seq_len, axis, value), self.context, axis)

    def chunk_ids(self) -> jax.Array:
        """[2] int32: the chunks this device holds (i and 2C-1-i), traced."""
        i = lax.axis_index(self.axis)
        return jnp.stack([i, 2 * self.context - 1 - i]).astype(jnp.int32)

    def offsets(self) -> list[jax.Array]:
        """The global position of each local chunk's first token (traced int32 scalars)."""
        ids = self.chunk_ids()
        return [ids[c] * self.chunk for c in range(2)]

    def pieces(self) -> list[tuple[int, int, jax.Array]]:
        """(first local row, rows, global position of the first row) of each run of consecutive positions."""
        return [(c * self.chunk, self.chunk, off) for c, off in enumerate(self.offsets())]

    def positions(self) -> jax.Array:
        """[2S] int32: the global positions of this device's tokens."""
        ids = self.chunk_ids()
        return (ids[:, None] * self.chunk + jnp.arange(self.chunk, dtype=jnp.int32)[None, :]).reshape(-1)

    def real(self) -> jax.Array:
        """[2S] bool: this device's tokens that are not padding."""
        return self.positions() < self.real_len

    def _natural(self, gathered: jax.Array, axis: int) -> jax.Array:
        return _permute_chunks(gathered, axis, 2 * self.context, natural_slots(self.context))

    def gather(self, x_BxLxR: jax.Array) -> jax.Array:
        """[B, 2S, ...] local tokens -> [B, T', ...] the whole sequence in position order (all-gather)."""
        return self._natural(lax.all_gather(x_BxLxR, self.axis, axis=1, tiled=True), 1)

    def prev_tails(self, x_BxLxR: jax.Array, n: int) -> jax.Array:
        """[B, 2, n, ...]: for each local chunk, the n tokens just before it (zeros before position 0).

        An all-gather of the last n tokens of every chunk (2C n rows), from which each
        device takes those of chunks i - 1 and 2C-2-i.
        """
        B, S = x_BxLxR.shape[0], self.chunk
        tails = x_BxLxR.reshape(B, 2, S, *x_BxLxR.shape[2:])[:, :, S - n :]
        gathered = lax.all_gather(tails, self.axis, axis=1, tiled=True)  # [B, 2C, n, ...] device order
        natural = jnp.take(gathered, jnp.asarray(natural_slots(self.context)), axis=1)
        # Slot c of `before` holds the tail of chunk c - 1 (slot 0: zeros, nothing precedes chunk 0).
        before = jnp.concatenate([jnp.zeros_like(natural[:, :1]), natural[:, :-1]], axis=1)
        return jnp.take(before, self.chunk_ids(), axis=1)

    def compress_chunks(self, x_BxLxKxD: jax.Array, compressor, l: int, d: int):
        """(the compressed tokens of the whole sequence [B, Tc', K, D], this device's own [B, 2S/d, K, D],
        [2S/d] bool: which of its own a one-device run has), Tc' = (T' - l)/d + 1.

        Each chunk compresses the blocks that end in it: S/d blocks whose first l - d
        tokens may lie in the previous chunk (prev_tails). Chunk 0 has l/d - 1 fewer
        (its first slots read zeros before position 0): they are dropped after the gather.
        The mask leaves out those and the blocks that end in the padding (for statistics).
        """
        B, S, K, D = x_BxLxKxD.shape[0], self.chunk, x_BxLxKxD.shape[2], x_BxLxKxD.shape[3]
        halo = l - d
        chunks = x_BxLxKxD.reshape(B, 2, S, K, D)
        if halo:
            chunks = jnp.concatenate([self.prev_tails(x_BxLxKxD, halo), chunks], axis=2)
        per_chunk = S // d
        own = compressor(chunks.reshape(B * 2, halo + S, K, D)).reshape(B, 2 * per_chunk, K, D)
        junk = l // d - 1  # chunk 0's leading slots: blocks that would start before position 0
        # Slot j of chunk c is the compressed token of index c S/d - junk + j (its block starts at index * d).
        i_2xJ = self.chunk_ids()[:, None] * per_chunk - junk + jnp.arange(per_chunk, dtype=jnp.int32)[None, :]
        real = (i_2xJ >= 0) & (i_2xJ * d + l <= self.real_len)
        return self.gather(own)[:, junk:], own, real.reshape(-1)


@dataclasses.dataclass(frozen=True)
class WholeSequence:
    """SeqLayout's reading methods for a device that holds whole sequences of `seq_len` tokens
    (no context parallelism): one piece at position 0, nothing gathered, every token real."""

    seq_len: int

    def pieces(self) -> list[tuple[int, int, int]]:
        return [(0, self.seq_len, 0)]

    def positions(self) -> jax.Array:
        return jnp.arange(self.seq_len, dtype=jnp.int32)

    def real(self) -> None:
        return None

    def gather(self, x_BxLxR: jax.Array) -> jax.Array:
        return x_BxLxR

    def compress_chunks(self, x_BxLxKxD: jax.Array, compressor, l: int, d: int):
        compressed = compressor(x_BxLxKxD)
        return compressed, compressed, None


def seq_layout(cfg: Config, seq_len: int | None = None) -> SeqLayout | None:
    """The layout of cfg's sequences (of `seq_len`, default train.seq_len) over parallel.context
    devices; None without context parallelism."""
    C, a = cfg.parallel.context, cfg.model.nsa
    T = cfg.train.seq_len if seq_len is None else seq_len
    return None if C == 1 else SeqLayout(C, chunk_len(T, C, a.l, a.lp), T)
