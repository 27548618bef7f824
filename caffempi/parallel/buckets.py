"""Buckets: the gradients of whole layers, in reverse layer order, grouped
into contiguous ranges of the net's flat gradient buffer, so that each range
can be summed over the ranks as soon as backward has finished its layers."""
import numpy as np

# LeNet's 1.7 MB of gradients in one or two buckets was best on the
# development VM, 4 MB the same on CIFAR10-quick (docs/design/parallel.md);
# DDP's small first bucket starts the first message early.
DEFAULT_BUCKET_MB = 4.0
DEFAULT_FIRST_BUCKET_MB = 1.0


def layer_param_ranges(net):
    """{layer index: (start, end)} of the flat-buffer range each layer owns."""
    ranges = {}
    for p, li in enumerate(net.param_layer_index):
        s = net.param_offsets[p]
        e = s + net.learnable_params[p].count
        if li in ranges:
            ranges[li] = (min(ranges[li][0], s), max(ranges[li][1], e))
        else:
            ranges[li] = (s, e)
    return ranges


def group_buckets(nbytes, bucket_mb=DEFAULT_BUCKET_MB, first_bucket_mb=DEFAULT_FIRST_BUCKET_MB):
    """The bucket rule, on the byte sizes of the layers with parameters in
    reverse layer order: lists of positions in ``nbytes``, one per bucket.
    The first bucket closes at first_bucket_mb, the others at bucket_mb
    (None: never), and the lowest layer always has a bucket of its own: its
    gradient is final only when backward ends, so its sum is never hidden
    (LeNet: conv2's bucket then starts under pool1's and conv1's backward).
    tools/scaling_model.py models the gradient sync with the same rule."""
    groups, cur, size = [], [], 0
    cap = first_bucket_mb
    for i, b in enumerate(nbytes):
        cur.append(i)
        size += b
        if cap is not None and size >= cap * 2 ** 20:
            groups.append(cur)
            cur, size, cap = [], 0, bucket_mb
    if cur:
        groups.append(cur)
    if groups and len(groups[-1]) > 1:
        groups.append([groups[-1].pop()])
    return groups


def make_buckets(net, bucket_mb=DEFAULT_BUCKET_MB, first_bucket_mb=DEFAULT_FIRST_BUCKET_MB, exclude=()):
    """Buckets of whole layers in reverse layer order (:func:`group_buckets`):
    list of (ready_layer, start, end, layer indices); ready_layer is the
    bucket's lowest layer, after whose backward the bucket's gradients are
    final.  The learnable params in ``exclude`` (indices) are summed by other
    means (:func:`bucket_segments`) and do not count towards a bucket's size."""
    itemsize = np.dtype(net.dtype).itemsize
    ranges = layer_param_ranges(net)
    order = sorted(ranges, reverse=True)
    sizes = {li: ranges[li][1] - ranges[li][0] for li in order}
    for p in exclude:
        sizes[net.param_layer_index[p]] -= net.learnable_params[p].count
    out = []
    for group in group_buckets([sizes[li] * itemsize for li in order], bucket_mb, first_bucket_mb):
        layers = [order[i] for i in group]
        lo, hi = min(layers), max(layers)
        out.append((lo, ranges[lo][0], ranges[hi][1], layers))
    return out


def bucket_segments(net, bucket, exclude=()):
    """The [start, end) ranges of ``bucket`` that are summed over the ranks:
    its range less those of the learnable params in ``exclude``."""
    return net.param_ranges(bucket[1], bucket[2], exclude)
