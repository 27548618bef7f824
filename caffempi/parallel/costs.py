"""The rates the reducer's plan weighs (:meth:`BucketedAllreduce.attach
<caffempi.parallel.sync.BucketedAllreduce.attach>`): the link's bandwidth
and latency, the GEMM rate and the memory rate, measured once when a net
is attached (rank 0's figures, broadcast, so every rank plans alike) or
given (``--link_gbps``, ``--gemm_gflops``).

Each way of combining a gradient is charged what crosses the link plus
the work it adds on the rank: the exact allreduce (a ring: 2(P-1)/P of the
bytes; bucketed, so no latency a param), sufficient factors
(:mod:`~caffempi.parallel.sfb`), low rank (:mod:`~caffempi.parallel.powersgd`).
Overlap with backward is not modelled (an overlap-aware rule was tried and
chose worse on emulated hosts: docs/design/parallel.md).
"""
import time
from dataclasses import dataclass

import numpy as np

from ..backend import kernels
from ..common import log


@dataclass(frozen=True)
class Costs:
    """``ranks``; ``bandwidth`` in bytes/s; ``latency`` in seconds a
    message; ``gemm_rate`` in FLOP/s; ``memory_rate``: bytes/s that a
    pass over an array reads and writes (``a += b``: 3 bytes a byte of a)."""
    ranks: int
    bandwidth: float
    latency: float
    gemm_rate: float
    memory_rate: float

    def allreduce_seconds(self, nbytes):
        """A ring allreduce of ``nbytes``: 2(P-1)/P of them cross each link."""
        return 2.0 * (self.ranks - 1) / self.ranks * nbytes / self.bandwidth

    def gather_seconds(self, nbytes_a_rank, messages=1):
        """``messages`` all-gathers of ``nbytes_a_rank`` in all from each rank."""
        return messages * self.latency + (self.ranks - 1) * nbytes_a_rank / self.bandwidth

    def gemm_seconds(self, flops):
        return flops / self.gemm_rate

    def pass_seconds(self, nbytes):
        """Reading and writing ``nbytes`` (a pass over an array)."""
        return nbytes / self.memory_rate


def measure_gemm_rate(repeats=1):
    """FLOP/s of this process's float32 GEMM (kernels.matmul, on the
    process's kernel threads) on a product of fc-layer proportions."""
    a = np.ones((256, 2048), np.float32)
    b = np.ones((2048, 1024), np.float32)
    kernels.matmul(np, a, b)
    t = time.perf_counter()
    for _ in range(repeats):
        kernels.matmul(np, a, b)
    return repeats * 2.0 * 256 * 2048 * 1024 / max(time.perf_counter() - t, 1e-9)


def measure_memory_rate(nbytes=32 << 20, repeats=3):
    """Bytes/s of ``a += b`` over float32 arrays of ``nbytes`` (reads of a
    and b, the write of a), the fastest of ``repeats``."""
    a = np.ones(nbytes // 4, np.float32)
    b = np.ones_like(a)
    best = float("inf")
    for _ in range(repeats + 1):              # the first touches the pages
        t = time.perf_counter()
        a += b
        best = min(best, time.perf_counter() - t)
    return 3.0 * nbytes / max(best, 1e-9)


def measure_link(world, what="the link's calibration"):
    """(bytes/s, seconds a message) of the world's allreduce: the median of
    3 sums of 8 B and of 4 MB (collective)."""
    times = {}
    for nbytes in (8, 4 << 20):
        buf = np.zeros(nbytes // 4, np.float32)
        world.allreduce_sum(buf, what)
        samples = []
        for _ in range(3):
            world.barrier(what)
            t = time.perf_counter()
            world.allreduce_sum(buf, what)
            samples.append(time.perf_counter() - t)
        times[nbytes] = float(np.median(samples))
    latency = times[8]
    span = max(times[4 << 20] - latency, 1e-9)
    return 2.0 * (world.size - 1) / world.size * (4 << 20) / span, latency


def measure_costs(world, link_gbps=0.0, gemm_gflops=0.0):
    """The :class:`Costs` every rank plans with: the given link and GEMM
    rate, else measured here; rank 0's figures (collective)."""
    if link_gbps > 0:
        bandwidth, latency = link_gbps * 1e9 / 8, 0.0
    else:
        bandwidth, latency = measure_link(world)
    rates = (gemm_gflops * 1e9 if gemm_gflops > 0 else measure_gemm_rate(), measure_memory_rate())
    costs = Costs(world.size, bandwidth, latency, *rates)
    costs = world.bcast(costs, 0, "rank 0's link and compute rates")
    if world.rank == 0:
        log.info("Plan: link %.3g Gbit/s, %.3g us a message, GEMM %.3g GFLOP/s, memory %.3g GB/s%s",
                 costs.bandwidth * 8 / 1e9, costs.latency * 1e6, costs.gemm_rate / 1e9, costs.memory_rate / 1e9,
                 "" if link_gbps > 0 and gemm_gflops > 0 else " (measured)")
    return costs
