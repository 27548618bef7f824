import os
from pathlib import Path

import pytest

# One BLAS thread per process keeps the suite predictable on small machines
# and under mpiexec (set before NumPy loads BLAS in subprocesses too).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]
ZOO = REPO.parent / "shared" / "caffe-zoo"


@pytest.fixture
def zoo():
    if not ZOO.is_dir():
        pytest.skip("../shared/caffe-zoo is absent")
    return ZOO


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CuPy and a CUDA device (skips cleanly without)")
