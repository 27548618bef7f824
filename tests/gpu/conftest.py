import pytest

from caffempi.backend import cupy_or_none


@pytest.fixture(scope="session")
def cupy():
    """CuPy with a working CUDA device, or a clean skip (CI has no GPU)."""
    cp = cupy_or_none()
    if cp is None:
        pytest.skip("CuPy is not installed or does not load")
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except Exception as e:      # no driver, or no device visible
        pytest.skip("no usable CUDA device (%s)" % e)
    return cp

