"""--comm_dtype=fp16 over every --comm that can carry it: shm (the ranks'
pieces added in shared memory), overlap (polled exchange), blocking and
thread give the same bits for the same buckets, the mean (scale 1/N)
folded in; hierarchical (float32 on the host, float16 across hosts) is
within float16's rounding of the mean, the same on every rank; nccl is
refused with the reason."""
import numpy as np

from caffempi.common import CaffeError
from caffempi.parallel.comm import get_world
from caffempi.parallel.rank import install_abort_handlers
from caffempi.parallel.transports import make_transport

SIZES = (7, 1, 40000, 2, 3, 70000)


def sums(world, mode):
    t = make_transport(world, mode, np, 4 * sum(SIZES), "fp16")
    rng = np.random.RandomState(world.rank)
    bufs = [(rng.standard_normal(n) * 10.0 ** rng.randint(-7, 2)).astype(np.float32) for n in SIZES]
    mine = [b.copy() for b in bufs]
    handles = [t.allreduce_start(b, 1.0 / world.size) for b in bufs] if t.overlaps_backward else []
    t.backward_end()
    if not t.overlaps_backward:
        handles = [t.allreduce_start(b, 1.0 / world.size) for b in bufs]
    for h in handles:
        t.wait(h)
    name = t.name
    t.close()
    return name, bufs, mine


def main():
    world = get_world("thread")
    install_abort_handlers(world)
    results = {}
    for mode in ("overlap", "shm", "blocking", "thread", "hierarchical"):
        name, bufs, mine = sums(world, mode)
        results[mode] = bufs
        assert name == {"overlap": "fp16", "shm": "fp16-shm", "blocking": "fp16-blocking",
                        "thread": "fp16-thread", "hierarchical": "fp16-hierarchical"}[mode], name
        for b, m in zip(bufs, mine):
            mean = world.comm.allreduce(m.astype(np.float64)) / world.size
            np.testing.assert_allclose(b, mean, rtol=0, atol=2e-3 * np.abs(mean).max())
    for mode, bufs in results.items():
        if mode != "hierarchical":
            for b, ref in zip(bufs, results["overlap"]):
                assert np.array_equal(b.view(np.uint32), ref.view(np.uint32)), (mode, b.size)
    for mode in ("shm", "hierarchical"):
        everyone = world.allgather(b"".join(b.tobytes() for b in results[mode]))
        assert all(e == everyone[0] for e in everyone), (mode, "ranks differ")
    try:
        make_transport(world, "nccl", np, 0, "fp16")
    except CaffeError as e:
        assert "--comm_dtype=fp16 cannot go with --comm=nccl" in str(e), e
    else:
        raise AssertionError("nccl took fp16")
    if world.rank == 0:
        print("FP16 MODES OK")


if __name__ == "__main__":
    main()
