"""--comm=auto on one host whose /dev/shm has too little room for the
shared-memory sums: every rank falls back to MPI together, rank 0 says why,
and the sums are right (the window's pages would otherwise kill the first
rank that touched one past the tmpfs's size, with SIGBUS)."""
import numpy as np

from caffempi.parallel.transports import make_transport, shm
from caffempi.parallel.comm import get_world
from caffempi.parallel.rank import init_rank_logging, install_abort_handlers


def main():
    world = get_world("overlap")
    install_abort_handlers(world)
    init_rank_logging(world)
    shm.free_bytes = lambda path: 10 * 2 ** 20
    t = make_transport(world, "auto", np, 20 * 2 ** 20)
    assert t.name == "mpi-host-overlap", t.name
    b = np.full(1000, world.rank + 1.0)
    t.allreduce(b)
    assert np.array_equal(b, np.full(1000, world.size * (world.size + 1) / 2.0))
    t.close()
    # with room, the same call sums in shared memory
    shm.free_bytes = lambda path: 200 * 2 ** 20
    t = make_transport(world, "auto", np, 20 * 2 ** 20)
    assert t.name == "shm", t.name
    t.close()


if __name__ == "__main__":
    main()
