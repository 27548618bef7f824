"""Elementwise and per-channel passes in blocks on the intra-op threads.

A pass over a large activation (ReLU, Eltwise, Scale, BatchNorm) runs as
one call per block on the intra-op threads (NumPy releases the GIL in its
ufuncs and reductions), and a pass of several steps keeps its block in
cache between them instead of going over the whole array once a step.
The blocks depend on the shape alone and each channel lies in one block,
so per-channel sums are bitwise the same for any thread count.
"""
from .. import threads

# Flat blocks: large enough that handing the GIL over between calls is a
# small part of each call, small enough to spread over the threads.
ELEMENT_BLOCK_BYTES = 1 << 20

# Blocks of channels: a pass of several steps reads and writes a few arrays
# of this size per block, which stay in L2 between the steps.
CHANNEL_BLOCK_BYTES = 512 << 10


def _for_blocks(count, per_item_bytes, limit, body, starts=()):
    """body(block) for slices ``block`` of range(count) of at most ``limit``
    bytes (at least one item), none crossing an offset in ``starts``, on
    the intra-op threads."""
    step = max(1, limit // max(per_item_bytes, 1))
    bounds = sorted({0, count, *(s for s in starts if 0 < s < count)})
    blocks = [slice(a, min(a + step, end)) for start, end in zip(bounds, bounds[1:]) for a in range(start, end, step)]
    threads.for_chunks(len(blocks), lambda i: body(blocks[i]))


def for_element_blocks(size, itemsize, body, starts=()):
    """body(block) for slices ``block`` covering range(size) (a flat
    array's elements), on the intra-op threads; none crosses an offset in
    ``starts`` (where a block must begin: the solver's update begins one
    where the params' multipliers change)."""
    _for_blocks(size, itemsize, ELEMENT_BLOCK_BYTES, body, starts)


def for_channel_blocks(shape, itemsize, body):
    """body(block) for slices ``block`` of axis 1 of (outer, C, inner)
    arrays of ``shape``, each channel in exactly one block, on the
    intra-op threads."""
    outer, channels, inner = shape
    _for_blocks(channels, outer * inner * itemsize, CHANNEL_BLOCK_BYTES, body)
