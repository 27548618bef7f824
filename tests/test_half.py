"""backend/half.py: the compiled float16 conversions give NumPy's bits."""
import numpy as np
import pytest

from caffempi.backend import denormals, half
from caffempi.testing.gil import stall_shares

compiled = pytest.mark.skipif(not half.available(), reason="the kernels need x86-64 with F16C, and llvmlite")
SIZES = (0, 1, 31, 32, 33, 1000, 4099)


def values(n, seed):
    """float32 over float16's whole range and past it (subnormals, float32
    denormals, overflow), with a NaN and infinities where there is room."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-100, 14, n))).astype(np.float32)
    x[:3] = [np.nan, np.inf, -np.inf][:n]
    return x


def expected_half(x, scale):
    with np.errstate(over="ignore", invalid="ignore"):
        return (x * np.float32(scale)).astype(np.float16)


@pytest.fixture(params=[False, True], ids=["ieee", "flush"])
def flush_mode(request):
    """Results must not depend on flush-to-zero (set in computing threads)."""
    before = denormals.set_flush(request.param)
    if request.param and before is None:
        pytest.skip("no flush-to-zero control here")
    yield
    if before is not None:
        denormals.set_flush(before)


@compiled
@pytest.mark.parametrize("n", SIZES)
def test_to_half_and_back_match_numpy_bitwise(n, flush_mode):
    x = values(n, n)
    out = np.empty(n, np.float16)
    half.to_half(x, 2.0 ** 5, out)
    assert np.array_equal(out.view(np.uint16), expected_half(x, 2.0 ** 5).view(np.uint16))
    back = np.empty(n, np.float32)
    half.from_half(out, 2.0 ** -5, back)
    assert np.array_equal(back.view(np.uint32), np.multiply(out, np.float32(2.0 ** -5)).view(np.uint32))


@compiled
@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("n", SIZES)
def test_sum_halves_matches_rank_ordered_float32_sum(n, ranks, flush_mode):
    pieces = np.stack([expected_half(values(n, 10 * r + n), 2.0 ** -3) for r in range(ranks)])
    out = np.empty(n, np.float16)
    half.sum_halves(pieces, out)
    total = pieces[0].astype(np.float32)
    for piece in pieces[1:]:
        total += piece
    with np.errstate(over="ignore", invalid="ignore"):
        assert np.array_equal(out.view(np.uint16), total.astype(np.float16).view(np.uint16))


def test_fallback_for_other_layouts_and_types():
    """Strided sources and float64 destinations take NumPy's path, same
    values (this path also runs where the kernels do not)."""
    x = values(200, 7)[::2]
    out = np.empty(100, np.float16)
    half.to_half(x, 0.5, out)
    assert np.array_equal(out.view(np.uint16), expected_half(x, 0.5).view(np.uint16))
    wide = np.empty(100, np.float64)
    half.from_half(out, 4.0, wide)
    assert np.array_equal(wide, out.astype(np.float64) * 4, equal_nan=True)
    summed = np.empty(50, np.float16)
    half.sum_halves(out.reshape(2, 50), summed)
    assert np.array_equal(summed, (out[:50].astype(np.float32) + out[50:]).astype(np.float16), equal_nan=True)


@compiled
def test_conversions_release_the_gil():
    """They run on the communication thread while the computing thread
    works."""
    x = np.random.default_rng(0).standard_normal(1 << 24).astype(np.float32)
    out = np.empty(x.size, np.float16)
    assert min(stall_shares(lambda: half.to_half(x, 1.0, out))) < 0.5


@compiled
@pytest.mark.parametrize("ranks", [1, 3])
def test_sum_halves_scales_each_row_and_the_sum_and_takes_strided_rows(ranks, flush_mode):
    """Each rank's piece times its own scale, the float32 sum times the
    result's scale, rounded once; rows may be strided (a value rides after
    each piece, as the exchange sends it)."""
    n = 1000
    rows = np.stack([expected_half(values(n + 1, 7 * r + 1), 2.0 ** -2) for r in range(ranks)])
    pieces = rows[:, :n]
    scales = (np.float32(2.0) ** np.arange(-3, -3 + ranks)).astype(np.float32)
    out = np.empty(n, np.float16)
    half.sum_halves(pieces, out, scales, 2.0 ** -1)
    total = pieces[0].astype(np.float32) * scales[0]
    for piece, scale in zip(pieces[1:], scales[1:]):
        total += piece.astype(np.float32) * scale
    with np.errstate(over="ignore", invalid="ignore"):
        expected = (total * np.float32(0.5)).astype(np.float16)
    assert np.array_equal(out.view(np.uint16), expected.view(np.uint16))
