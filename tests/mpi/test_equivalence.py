"""N ranks x batch b == one process x batch N*b: gradients, losses and
weights after a few momentum-SGD steps agree to float32 rounding."""
import numpy as np
import pytest

from .mpirun import WORKERS, mpirun, needs_mpi, single

W = WORKERS / "equiv_worker.py"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "ref.npz"
    single([W, out, "blocking", 12, 4, 1])
    return np.load(out)


def _compare(ref, got):
    for k in ref.files:
        scale = max(1.0, float(np.abs(ref[k]).max()))
        np.testing.assert_allclose(got[k], ref[k], rtol=0, atol=2e-6 * scale, err_msg=k)


@needs_mpi
@pytest.mark.parametrize("n,comm,iter_size,bucket_mb", [
    (2, "overlap", 1, 0.001),     # one bucket per layer
    (2, "blocking", 1, 4),
    (2, "thread", 2, 0.001),      # iter_size on top
    (3, "overlap", 1, 4),
    (2, "shm", 1, 0.001),
    (3, "shm", 2, 4),
])
def test_ranks_match_single_process(tmp_path, reference, n, comm, iter_size, bucket_mb):
    out = tmp_path / "r.npz"
    mpirun(n, [W, out, comm, 12, 4, iter_size, bucket_mb])
    _compare(reference, np.load(out))
