"""--sync=easgd follows Torch DistLearn's AllReduceEA update rule."""
import pytest

from .mpirun import WORKERS, mpirun, needs_mpi


@needs_mpi
@pytest.mark.parametrize("n", [2, 3])
def test_easgd_rule(n):
    p = mpirun(n, [WORKERS / "easgd_worker.py", 3, 0.2], timeout=60)
    assert "EASGD OK rounds=3" in p.stdout


def test_easgd_single_process_moves_toward_center():
    import numpy as np
    from caffempi.parallel.comm import SingleWorld
    from caffempi.parallel.easgd import ElasticAverager
    ea = ElasticAverager(SingleWorld(), tau=2, alpha=0.5)
    w = np.zeros(3, np.float32)
    ea.start(w)                      # centre = 0
    assert not ea.after_update(w)
    w += 2
    assert ea.after_update(w)        # delta = 0.5*(2-0) = 1
    np.testing.assert_allclose(w, 1.0)
    np.testing.assert_allclose(ea.center, 1.0)
