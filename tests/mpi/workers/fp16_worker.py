"""--comm_dtype=fp16's transport: buckets of any size (fewer elements than
ranks too) sum exactly where every value and the sum are float16 numbers,
within float16 rounding of the float32 sum otherwise, and every rank ends
with the same bits; buckets overlap in flight, as during backward.  Values
of gradients' magnitudes (1e-6, float16 subnormals unscaled) keep float16's
relative precision (the transport scales each bucket by a power of two).
argv[1]: --comm (overlap: polled; thread: on a communication thread)."""
import sys

import numpy as np

from caffempi.parallel.comm import get_world
from caffempi.parallel.compression import Float16
from caffempi.parallel.rank import install_abort_handlers
from caffempi.parallel.transports import make_transport


def own_scales(world, t, it):
    """Each rank's piece rounded under its own scale, which travels with it
    (no agreement on one first): rank r's values are 2^(4r) times rank 0's,
    so the ranks' scales differ, and the sum has exactly these bits."""
    rng = np.random.RandomState(7 + it)
    values = [(rng.standard_normal(999) * 2.0 ** (4 * r - 12)).astype(np.float32) for r in range(world.size)]
    fp16 = Float16()
    scales = [fp16.piece_scale(fp16.largest(v), world.size) for v in values]
    total = sum((v * np.float32(s)).astype(np.float16).astype(np.float32) * np.float32(1 / s)
                for v, s in zip(values, scales))
    low = min(scales)
    want = (total * np.float32(low)).astype(np.float16).astype(np.float32) * np.float32(0.5 / low)
    buf = values[world.rank].copy()
    t.wait(t.allreduce_start(buf, 0.5))
    assert np.array_equal(buf, want), (it, np.abs(buf - want).max())


def main():
    mode = sys.argv[1]
    world = get_world(mode)
    install_abort_handlers(world)
    t = make_transport(world, mode, np, 0, "fp16")
    assert t.name == {"overlap": "fp16", "thread": "fp16-thread"}[mode], t.name
    sizes = (7, 1, 40000, 2, 3)
    tri = world.size * (world.size + 1) // 2
    for it in range(5):
        exact = [(np.arange(n, dtype=np.float32) % 64) * (world.rank + 1) + it for n in sizes]
        handles = [t.allreduce_start(b) for b in exact]
        rng = np.random.RandomState(100 * it + world.rank)
        noisy = rng.standard_normal(5000).astype(np.float32)
        mine = noisy.copy()
        handles.append(t.allreduce_start(noisy))
        tiny = (rng.standard_normal(5000) * 1e-6).astype(np.float32)
        tiny_mine = tiny.copy()
        handles.append(t.allreduce_start(tiny))
        t.backward_end()
        for h in handles:
            t.wait(h)
        for b in exact:
            want = (np.arange(b.size, dtype=np.float32) % 64) * tri + it * world.size
            assert np.array_equal(b, want), (it, b.size)
        total = world.comm.allreduce(mine.astype(np.float64))
        np.testing.assert_allclose(noisy, total, rtol=4e-3, atol=4e-3)
        tiny_total = world.comm.allreduce(tiny_mine.astype(np.float64))
        # float16 has 11 significant bits: each rounding is within 2^-11 of the largest value
        np.testing.assert_allclose(tiny, tiny_total, rtol=0, atol=2e-3 * np.abs(tiny_total).max())
        everyone = world.allgather(noisy.tobytes())
        assert all(e == everyone[0] for e in everyone), "ranks differ"
        own_scales(world, t, it)
    t.close()
    if world.rank == 0:
        print("FP16 OK")


if __name__ == "__main__":
    main()
