"""Data-parallel GPU training: 2 ranks x batch b equal one GPU process x
batch 2b (NCCL when each rank has its own GPU, MPI through pinned host
copies when they share one), and --comm=nccl refuses ranks sharing a GPU."""
import numpy as np
import pytest

from tests.mpi.mpirun import WORKERS, mpirun, needs_mpi, single

pytestmark = [pytest.mark.gpu, needs_mpi]
W = WORKERS / "equiv_worker.py"


def test_two_gpu_ranks_match_one(cupy, tmp_path):
    ref, got = tmp_path / "ref.npz", tmp_path / "got.npz"
    single([W, ref, "blocking", 12, 4, 1, 4, "gpu"], timeout=120)
    p = mpirun(2, [W, got, "auto", 12, 4, 1, 0.001, "gpu"], timeout=120)
    ref, got = np.load(ref), np.load(got)
    for k in ref.files:
        scale = max(1.0, float(np.abs(ref[k]).max()))
        np.testing.assert_allclose(got[k], ref[k], rtol=0, atol=2e-6 * scale, err_msg=k)
    shared_gpu = cupy.cuda.runtime.getDeviceCount() < 2
    assert ("NCCL not used" in p.stderr + p.stdout) == shared_gpu


def test_nccl_refuses_ranks_on_one_gpu(cupy, tmp_path):
    if cupy.cuda.runtime.getDeviceCount() > 1:
        pytest.skip("each rank has its own GPU here")
    p = mpirun(2, [W, tmp_path / "x.npz", "nccl", 12, 2, 1, 4, "gpu"], timeout=120, check=False)
    assert p.returncode != 0
    assert "share the GPU" in p.stderr + p.stdout
