"""Ranks take different local steps; every tau steps ElasticAverager must
follow AllReduceEA's rule, checked against the rule computed from all ranks'
gathered parameters."""
import sys

import numpy as np

from caffempi.parallel.comm import get_world
from caffempi.parallel.easgd import ElasticAverager
from caffempi.parallel.rank import install_abort_handlers


def main(tau=3, alpha=0.2, steps=10):
    world = get_world()
    install_abort_handlers(world)
    w = np.linspace(-1, 1, 50).astype(np.float32)        # equal start on all ranks
    center = w.copy()
    ea = ElasticAverager(world, tau, alpha)
    ea.start(w)
    rng = np.random.RandomState(10 + world.rank)          # different "gradients" per rank
    rounds = 0
    for step in range(1, steps + 1):
        w -= np.float32(0.1) * rng.randn(w.size).astype(np.float32)
        before = np.array(world.allgather(w.copy()))       # all ranks' params
        did = ea.after_update(w)
        assert did == (step % tau == 0)
        if did:
            rounds += 1
            exp_w = before[world.rank] - np.float32(alpha) * (before[world.rank] - center)
            exp_center = center + (np.float32(alpha) * (before - center)).sum(0)
            np.testing.assert_allclose(w, exp_w, atol=1e-6)
            np.testing.assert_allclose(ea.center, exp_center, atol=1e-5)
            center = ea.center.copy()
        else:
            np.testing.assert_array_equal(ea.center, center)
        cs = world.allgather(ea.center.copy())
        assert all(np.array_equal(c, cs[0]) for c in cs), "centres differ"
    assert rounds == steps // tau
    ea.synchronize(w)
    ws = world.allgather(w.copy())
    assert all(np.array_equal(x, ws[0]) for x in ws)
    if world.rank == 0:
        print("EASGD OK rounds=%d" % rounds)


if __name__ == "__main__":
    main(*[int(a) for a in sys.argv[1:2]], *[float(a) for a in sys.argv[2:3]])
