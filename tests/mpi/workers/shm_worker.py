"""--comm=shm on this host: the default for CPU buffers here, and its sums
exact whatever order and moment the ranks arrive in (random sleeps between
bucket starts, a buffer summed alone, float64 beside float32), over enough
iterations that the window and its flags are reused many times."""
import random
import time

import numpy as np

from caffempi.parallel.comm import get_world
from caffempi.parallel.rank import install_abort_handlers
from caffempi.parallel.transports import make_transport


def main():
    world = get_world("overlap")
    install_abort_handlers(world)
    sizes = (70000, 7, 1, 40000, 3)
    t = make_transport(world, "auto", np, sum(sizes) * 4 + 3000 * 8)
    assert t.name == "shm", t.name
    rng = random.Random(world.rank)
    tri = world.size * (world.size + 1) // 2
    for it in range(60):
        bufs = [np.arange(n, dtype=np.float32) * (world.rank + 1) + it for n in sizes]
        handles = []
        for b in bufs:
            if rng.random() < 0.3:
                time.sleep(rng.random() * 0.003)
            handles.append(t.allreduce_start(b))
        t.backward_end()
        for h in handles:
            t.wait(h)
        for b in bufs:
            want = np.arange(b.size, dtype=np.float32) * tri + it * world.size
            assert np.array_equal(b, want), (it, b.size)
        whole = np.full(3000, world.rank + 0.5)
        t.allreduce(whole)
        assert np.array_equal(whole, np.full(3000, tri - world.size / 2.0)), it
    t.close()


if __name__ == "__main__":
    main()
