"""The NumPy kernels' intra-op threads (caffempi.backend.threads): chunks run
on several threads, convolution, pooling and the layers' passes in blocks
give bitwise the same results for every thread count, products stay right,
errors come through, BLAS is kept at one thread."""
import threading
import time

import numpy as np
import pytest
from threadpoolctl import ThreadpoolController

from caffempi.backend import cpu, kernels, threads
from caffempi.backend.cpu import blocks, chunking, conv, pool
from caffempi.common import TEST, TRAIN
from caffempi.testing.gil import stall_shares
from caffempi.testing.gradient_check import check_gradient, run_layer


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of a few images even for test-sized inputs, so that the
    kernels have several chunks to spread over threads."""
    monkeypatch.setattr(chunking, "COL_CHUNK_BYTES", 2048)
    monkeypatch.setattr(conv, "DW_CHUNK_BYTES", 2048)


@pytest.fixture
def thread_counts():
    previous = threads.set_thread_count(1)
    yield (1, 2, 3)
    threads.set_thread_count(previous)


def at_each_count(counts, fn):
    results = []
    for t in counts:
        threads.set_thread_count(t)
        results.append(fn())
    threads.set_thread_count(1)
    return results


def rand(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


# (input shape, weight shape, geom (kh, kw, sh, sw, ph, pw, dh, dw), group):
# one per path of cpu.conv2d_forward / conv2d_backward
CONV_CASES = {
    "row taps, valid (LeNet conv2)": ((9, 12, 8, 8), (6, 12, 3, 3), (3, 3, 1, 1, 0, 0, 1, 1), 1),
    "one channel, im2col (LeNet conv1)": ((9, 1, 9, 9), (5, 1, 3, 3), (3, 3, 1, 1, 0, 0, 1, 1), 1),
    "padded same, dx as conv": ((9, 3, 8, 8), (4, 3, 3, 3), (3, 3, 1, 1, 1, 1, 1, 1), 1),
    "stride 2, col2im": ((9, 4, 9, 9), (6, 2, 3, 3), (3, 3, 2, 2, 1, 1, 1, 1), 2),
    "stride 2, long reduction, product per chunk": ((9, 16, 7, 7), (6, 16, 3, 3), (3, 3, 2, 2, 1, 1, 1, 1), 1),
    "dilated groups": ((9, 4, 9, 9), (6, 2, 3, 3), (3, 3, 1, 1, 0, 0, 2, 2), 2),
    "many outputs, images innermost dw": ((9, 8, 6, 6), (32, 8, 3, 3), (3, 3, 1, 1, 1, 1, 1, 1), 1),
    "pointwise": ((9, 6, 5, 5), (4, 3, 1, 1), (1, 1, 1, 1, 0, 0, 1, 1), 2),
    "long reduction, small output: columns per image": ((9, 120, 5, 5), (8, 120, 3, 3), (3, 3, 1, 1, 1, 1, 1, 1), 1),
}


@pytest.mark.parametrize("case", sorted(CONV_CASES))
def test_convolution_is_bitwise_the_same_on_any_thread_count(case, small_chunks, thread_counts):
    xs, ws, geom, group = CONV_CASES[case]
    x, w, b = rand(xs, 0), rand(ws, 1), rand(ws[:1], 2)

    def run():
        y = cpu.conv2d_forward(x, w, geom, group, b)
        dx, dw = cpu.conv2d_backward(x, w, rand(y.shape, 3), geom, group)
        return y, dx, dw
    results = at_each_count(thread_counts, run)
    for other in results[1:]:
        for a, o in zip(results[0], other):
            assert np.array_equal(a, o)
    # and the chunked result is the one of the whole batch at once
    chunking.COL_CHUNK_BYTES = conv.DW_CHUNK_BYTES = 1 << 30
    whole = run()
    for a, o in zip(results[0], whole):
        np.testing.assert_allclose(a, o, rtol=1e-4, atol=1e-4)


POOL_CASES = [((9, 3, 8, 8), (2, 2, 2, 2, 0, 0)),      # tiled
              ((9, 3, 10, 10), (3, 3, 2, 2, 0, 0)),    # 3x3/2
              ((9, 3, 9, 7), (3, 2, 2, 1, 1, 1))]      # general, padded


@pytest.mark.parametrize("shape, geom", POOL_CASES)
def test_pooling_is_bitwise_the_same_on_any_thread_count(shape, geom, small_chunks, thread_counts):
    kh, kw, sh, sw, ph, pw = geom
    oh = -(-(shape[2] + 2 * ph - kh) // sh) + 1
    ow = -(-(shape[3] + 2 * pw - kw) // sw) + 1
    x = rand(shape, 0)
    dy = rand(shape[:2] + (oh, ow), 1)

    def run():
        y, idx = cpu.max_pool_forward(x, geom, oh, ow)
        return (y, idx, cpu.max_pool_backward(dy, idx, geom, shape),
                cpu.ave_pool_forward(x, geom, oh, ow), cpu.ave_pool_backward(dy, geom, shape))
    results = at_each_count(thread_counts, run)
    for other in results[1:]:
        for a, o in zip(results[0], other):
            assert np.array_equal(a, o)
    # each image pooled alone gives the same
    for i in range(shape[0]):
        y, idx = np.empty((1,) + shape[1:2] + (oh, ow), np.float32), np.empty((1,) + shape[1:2] + (oh, ow), np.int32)
        pool.numpy_max_forward(x[i:i + 1], geom, oh, ow, y, idx)
        assert np.array_equal(results[0][0][i:i + 1], y) and np.array_equal(results[0][1][i:i + 1], idx)


@pytest.mark.parametrize("across_channels", [True, False])
def test_lrn_is_bitwise_the_same_on_any_thread_count_and_as_one_image_at_a_time(across_channels, small_chunks,
                                                                               thread_counts):
    x, dy = rand((9, 7, 6, 5), 0), rand((9, 7, 6, 5), 1)

    def run(x=x, dy=dy):
        y, scale = kernels.lrn_forward(np, x, 5, 0.01, 0.75, 2.0, across_channels)
        return y, scale, kernels.lrn_backward(np, x, y, scale, dy, 5, 0.01, 0.75, across_channels)
    results = at_each_count(thread_counts, run)
    # in chunks: several of them (chunks of ~2 images here)
    assert len(chunking.chunks(9, 3 * x[0].nbytes)) > 2
    for other in results[1:]:
        assert all(np.array_equal(a, o) for a, o in zip(results[0], other))
    for i in range(9):
        alone = run(x[i:i + 1], dy[i:i + 1])
        assert all(np.array_equal(a[i:i + 1], o) for a, o in zip(results[0], alone))


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of a few elements or channels even for test-sized arrays."""
    monkeypatch.setattr(blocks, "ELEMENT_BLOCK_BYTES", 64)
    monkeypatch.setattr(blocks, "CHANNEL_BLOCK_BYTES", 64)


def test_elementwise_and_per_channel_blocks_cover_the_arrays(small_blocks, thread_counts):
    x, y = rand((5, 7, 9), 0), rand((5, 7, 9), 1)
    seen = []

    def block(b):
        seen.append(b)
        kernels.sum_of_products(np, x[:, b], y[:, b], (0, 2))
    threads.set_thread_count(2)
    try:
        out = kernels.elementwise(np, np.subtract, x, y)
        kernels.per_channel(np, block, x.shape, x.dtype)
    finally:
        threads.set_thread_count(1)
    assert np.array_equal(out, x - y) and out.flags.c_contiguous
    channels = sorted(c for b in seen for c in range(7)[b])
    assert channels == list(range(7)) and len(seen) > 2


# (layer text, bottom shapes, top count, phase): the layers whose passes run
# in blocks on the threads
BLOCK_CASES = {
    "BatchNorm": ('type: "BatchNorm"', [(4, 6, 3, 5)], 1, TRAIN),
    "BatchNorm, global statistics": ('type: "BatchNorm"', [(4, 6, 3, 5)], 1, TEST),
    "BatchNorm, scale and bias": ('type: "BatchNorm" batch_norm_param { scale_bias: true '
                                  'bias_filler { type: "gaussian" } scale_filler { type: "gaussian" } }',
                                  [(4, 6, 3, 5)], 1, TRAIN),
    "MVN": ('type: "MVN"', [(4, 6, 3, 5)], 1, TRAIN),
    "Scale": ('type: "Scale" scale_param { bias_term: true filler { type: "gaussian" } '
              'bias_filler { type: "gaussian" } }', [(4, 6, 3, 5)], 1, TRAIN),
    "Scale, two bottoms": ('type: "Scale" scale_param { axis: 0 }', [(4, 6, 3, 5), (4, 6)], 1, TRAIN),
    "ReLU": ('type: "ReLU"', [(4, 6, 3, 5)], 1, TRAIN),
    "Eltwise": ('type: "Eltwise" eltwise_param { coeff: 1 coeff: -0.5 coeff: 2 }', [(4, 6, 3, 5)] * 3, 1, TRAIN),
    "Split": ('type: "Split"', [(4, 6, 3, 5)], 3, TRAIN),
}


def _layer_pass(text, shapes, tops, phase):
    """Forward and backward (random top diffs) of a float32 layer: its
    tops, bottom diffs and parameter diffs."""
    layer, bottom, top = run_layer(text, [rand(s, i) for i, s in enumerate(shapes)], tops, phase, np.float32)
    if phase == TEST:       # statistics to normalise with
        for i, blob in enumerate(layer.blobs[:3]):
            blob.data = np.abs(rand(blob.shape, 10 + i)) + 0.5
        layer.forward(bottom, top)
    for i, t in enumerate(top):
        t.diff = rand(t.shape, 20 + i)
    layer.backward(top, [True] * len(bottom), bottom)
    return [t.data.copy() for t in top] + [b.diff for b in bottom] + [p.diff for p in layer.blobs]


@pytest.mark.parametrize("case", sorted(BLOCK_CASES))
def test_layer_passes_in_blocks_are_bitwise_the_same_on_any_thread_count(case, small_blocks, thread_counts):
    results = at_each_count(thread_counts, lambda: _layer_pass(*BLOCK_CASES[case]))
    for other in results[1:]:
        for a, o in zip(results[0], other):
            assert a.dtype == o.dtype == np.float32 and np.array_equal(a, o)
    # and the blocks give what one block of everything gives
    blocks.ELEMENT_BLOCK_BYTES = blocks.CHANNEL_BLOCK_BYTES = 1 << 30
    for a, o in zip(results[0], _layer_pass(*BLOCK_CASES[case])):
        np.testing.assert_allclose(a, o, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["BatchNorm", "BatchNorm, scale and bias", "Scale", "Scale, two bottoms"])
def test_layer_gradients_in_blocks_on_two_threads(case, small_blocks, thread_counts):
    text, shapes, tops, phase = BLOCK_CASES[case]
    threads.set_thread_count(2)
    try:
        check_gradient(text, [np.random.RandomState(i).randn(*s) for i, s in enumerate(shapes)], num_top=tops)
    finally:
        threads.set_thread_count(1)


@pytest.mark.parametrize("m, k, n", [(200, 300, 100), (16, 300, 1000), (1, 4096, 512)])
def test_matmul_split_over_threads(m, k, n, thread_counts):
    a, b = rand((m, k), 0), rand((k, n), 1)
    expected = a.astype(np.float64) @ b.astype(np.float64)
    for t, r in zip(thread_counts, at_each_count(thread_counts, lambda: cpu.matmul(a, b.T.copy().T))):
        assert r.shape == (m, n)
        np.testing.assert_allclose(r, expected, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("layout", ["C", "F", "strided"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("m, k, n", [(8, 9, 5), (200, 8, 300), (70, 40, 1100)])
@pytest.mark.parametrize("accumulate", [True, False])
def test_matmul_into_writes_or_adds_in_place_on_any_thread_count(m, k, n, dtype, layout, accumulate,
                                                                 thread_counts):
    def operand(shape, seed):
        x = rand(shape, seed).astype(dtype)
        if layout == "F":
            return np.asfortranarray(x)
        return rand((shape[0], 2 * shape[1]), seed).astype(dtype)[:, ::2] if layout == "strided" else x
    a, b = operand((m, k), 0), operand((k, n), 1)
    start = rand((m, n), 2).astype(dtype)
    expected = start.astype(np.float64) * accumulate + a.astype(np.float64) @ b.astype(np.float64)

    def run():
        out = start.copy()
        assert cpu.matmul_into(a, b, out, accumulate) is out
        return out
    for r in at_each_count(thread_counts, run):
        np.testing.assert_allclose(r, expected, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("accumulate", [True, False])
def test_matmul_into_with_no_rows_to_sum(accumulate):
    out = np.full((3, 4), 2.0, np.float32)
    cpu.matmul_into(np.zeros((3, 0), np.float32), np.zeros((0, 4), np.float32), out, accumulate)
    assert np.array_equal(out, np.full((3, 4), 2.0 * accumulate, np.float32))


def test_matmul_into_lets_other_threads_run():
    """The weight gradient's GEMM releases the GIL: a thread that ticks
    every half millisecond keeps ticking through one long product (SciPy's
    BLAS held the GIL for the whole of it, stalling the communication
    thread)."""
    a, b = rand((8, 4096), 0), rand((8, 9216), 1)
    out = np.zeros((4096, 9216), np.float32)
    shares = stall_shares(lambda: cpu.matmul_into(a.T, b, out, accumulate=True))
    assert min(shares) < 0.5, shares


def test_chunks_run_on_several_threads_and_fold_in_order(thread_counts):
    names = set()
    folded = []

    def body(i):
        names.add(threading.current_thread().name)
        time.sleep(0.01 * (i % 3 == 0))   # finish out of order
        return i

    threads.set_thread_count(3)
    try:
        threads.for_chunks(12, body, folded.append)
    finally:
        threads.set_thread_count(1)
    assert folded == list(range(12))
    assert len(names) == 3


def test_an_error_in_a_chunk_comes_through(thread_counts):
    def body(i):
        if i == 5:
            raise ValueError("chunk 5")
        time.sleep(0.001)

    threads.set_thread_count(2)
    try:
        with pytest.raises(ValueError, match="chunk 5"):
            threads.for_chunks(40, body)
        # the region is free again and nested regions run serially
        inner = []
        threads.for_chunks(4, lambda i: threads.for_chunks(3, lambda j: inner.append(threading.current_thread().name)))
        assert len(inner) == 12
    finally:
        threads.set_thread_count(1)


@pytest.mark.parametrize("count", [1, 3])
def test_progress_runs_in_the_installing_thread_after_each_of_its_chunks(count, thread_counts):
    """The reducer's poll (threads.progress) runs between chunks, only
    in the thread that installed it, until the block ends."""
    events = []
    owner = threading.get_ident()

    def body(i):
        events.append(("chunk", threading.get_ident() == owner))
        time.sleep(0.002)

    def progress():
        events.append(("progress", threading.get_ident() == owner))

    threads.set_thread_count(count)
    try:
        assert threads.progress_here() is None
        with threads.progress(progress):
            threads.for_chunks(6, body)
            mine = [e for e in events if e[1]]
            assert len(mine) >= 2 and len(mine) % 2 == 0
            assert all(e == ("progress", True) for e in mine[1::2])
            assert ("progress", False) not in events
            # another thread's regions do not call it
            events.clear()
            t = threading.Thread(target=threads.for_chunks, args=(3, body))
            t.start()
            t.join()
            assert [e[0] for e in events] == ["chunk"] * 3
            assert threads.progress_here() is progress
        events.clear()
        threads.for_chunks(3, body)
        assert [e[0] for e in events] == ["chunk"] * 3
    finally:
        threads.set_thread_count(1)


@pytest.mark.parametrize("count", [1, 2])
def test_poll_inside_a_long_chunk_calls_the_installing_threads_progress(count, thread_counts):
    """A chunk body that runs long polls between its own pieces
    (threads.poll): the installing thread's progress runs there, helper
    threads' polls do nothing, and outside the block nothing runs."""
    calls = []
    owner = threading.get_ident()

    def body(i):
        for _ in range(3):
            time.sleep(0.002)
            threads.poll()

    threads.set_thread_count(count)
    try:
        with threads.progress(lambda: calls.append(threading.get_ident() == owner)):
            threads.for_chunks(2, body)
        assert all(calls)
        # 3 polls in each body the installing thread ran, 1 after each chunk
        # (on 2 threads it runs one body or both, or none if descheduled)
        assert len(calls) == 8 if count == 1 else len(calls) in (0, 4, 8)
        calls.clear()
        threads.for_chunks(2, body)
        assert not calls
    finally:
        threads.set_thread_count(1)


def test_blas_is_kept_at_one_thread():
    threads.thread_count()
    blas = ThreadpoolController().select(user_api="blas").lib_controllers
    numpy_blas = [lib for lib in blas if "numpy" in lib.filepath]
    assert numpy_blas and all(lib.num_threads == 1 for lib in numpy_blas)
