"""Chunks of images that the kernels work in, run on the intra-op threads
(:func:`caffempi.backend.threads.for_chunks`).

A chunk's working set (a convolution's column matrix, a pooling's images)
is kept under :data:`COL_CHUNK_BYTES`, so that its copies and GEMMs run
from cache: a whole batch's column matrix can be hundreds of MB
(docs/design/cpu.md).
"""
from .. import threads

# Working set of one chunk: the range where OpenBLAS runs the skinny
# convolution GEMMs fastest (docs/design/cpu.md, "Chunk size").
COL_CHUNK_BYTES = int(1.5 * (1 << 20))


def images_per_chunk(n, per_image_bytes, limit):
    """Images per chunk (1 to n) so that a chunk's column matrix stays under
    ``limit`` bytes (in cache, on the CPU)."""
    return int(max(1, min(n, limit // max(per_image_bytes, 1))))


def chunks(n, per_image_bytes, limit=None, multiple=1):
    """(a, m) for chunks of m images from image a, equal in size, each under
    ``limit`` (default :data:`COL_CHUNK_BYTES`; per image) as
    :func:`images_per_chunk`, and a ``multiple`` of them where n allows
    (the thread count, for kernels whose results do not depend on the
    chunks: no thread idles at the end)."""
    count = -(-n // images_per_chunk(n, per_image_bytes, limit or COL_CHUNK_BYTES))
    count = min(n, -(-count // multiple) * multiple)
    nb = -(-n // count)
    return [(a, min(nb, n - a)) for a in range(0, n, nb)]


def each_chunk(parts, body, fold=None):
    """body(a, m) for every (a, m) of ``parts``, on the intra-op threads;
    ``fold`` gets the results in order (see threads.for_chunks)."""
    threads.for_chunks(len(parts), lambda i: body(*parts[i]), fold)


def over_images(fn, inputs, outs):
    """fn(*inputs[images], *outs[images]) over chunks of images (by the size
    of an image of inputs and outs together) on the intra-op threads, fn
    writing its results into the chunks of outs: for kernels that treat
    every image alike (pooling, LRN), so a multiple of the thread count of
    chunks (a batch that fits one chunk's bytes still splits over the
    threads).  Returns outs."""
    n = inputs[0].shape[0]

    def chunk(a, m):
        fn(*[t[a:a + m] for t in inputs + outs])
    each_chunk(chunks(n, sum(t[:1].nbytes for t in inputs + outs), multiple=threads.thread_count()), chunk)
    return outs
