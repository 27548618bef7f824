"""Transports: how buckets of gradients are summed over the ranks
(interface: :class:`~caffempi.parallel.transports.base.Transport`).

``make_transport(world, mode, xp, nbytes)`` picks one by ``--comm`` and by
where the buffers live:

=========  ===================================  ======================================
--comm     NumPy buffers (CPU nets)             CuPy buffers (GPU nets)
=========  ===================================  ======================================
auto       shm when every rank is on this host  nccl when NCCL can join the ranks,
           and /dev/shm has room; hierarchical  else overlap through pinned copies
           when the ranks span several hosts
           and some host has several; else
           thread (overlap without
           MPI_THREAD_MULTIPLE)
shm        shm (else overlap, with a warning)   refused
hierarch.  hierarchical.HierarchicalTransport   refused
overlap    mpi.OverlapTransport                 staged.StagedTransport(overlap)
nopoll     mpi.IallreduceTransport              staged (nopoll)
async      mpi.AsyncProgressTransport           staged (async)
thread     mpi.ThreadTransport                  staged (thread)
blocking   mpi.BlockingTransport                staged (blocking)
nccl       refused                              nccl.NCCLTransport (refused when NCCL
                                                cannot join the ranks)
=========  ===================================  ======================================

``--comm_dtype=fp16`` (CPU nets) sends buckets through a compressor
(:mod:`~caffempi.parallel.compression`) to a transport that adds the pieces
itself: shm (when asked for) adds them in shared memory; hierarchical sums
each host in float32 and compresses the sum across hosts; blocking,
overlap, nopoll, async and thread take
:class:`~caffempi.parallel.transports.exchange.ExchangeTransport` (polled,
blocking, or on a communication thread as for float32); auto takes
hierarchical where float32 would, else the exchange (threaded where a
communication thread fits); nccl is refused (NCCL's reductions cannot add
float16 pieces in float32).
One rank needs no transport: :class:`~caffempi.parallel.transports.base.LocalTransport`.
A new transport subclasses ``Transport`` and gets a row here.

``make_chained_transport(world, compressor)`` makes the sums a plug-in
chains its own work on (low rank's P and Q): float32 Iallreduces or the
compressed exchange, as :class:`~caffempi.parallel.transports.chained.ChainedTransport`
whose handles say when each sum is in.
"""
import numpy as np

from ...common import CaffeError, log
from ..compression import COMPRESSORS
from .base import LocalTransport, Transport  # noqa: F401  (the interface)
from .mpi import HOST_TRANSPORTS
from .chained import IallreduceChains
from .exchange import ExchangeTransport
from .hierarchical import HierarchicalTransport
from .shm import make_shm_transport

COMM_MODES = ("auto", "shm", "hierarchical", "overlap", "blocking", "thread", "async", "nopoll", "nccl")
COMM_DTYPES = ("fp32",) + tuple(COMPRESSORS)


def check_comm_mode(mode):
    if mode not in COMM_MODES:
        raise CaffeError("unknown --comm '%s' (one of %s)" % (mode, ", ".join(COMM_MODES)))


def check_comm_dtype(dtype):
    if dtype not in COMM_DTYPES:
        raise CaffeError("unknown --comm_dtype '%s' (one of %s)" % (dtype, ", ".join(COMM_DTYPES)))


def make_compressor(dtype):
    """The compressor of ``--comm_dtype`` (None for fp32)."""
    check_comm_dtype(dtype)
    return COMPRESSORS[dtype]() if dtype in COMPRESSORS else None


def make_transport(world, mode="overlap", xp=np, nbytes=0, dtype="fp32"):
    """The transport for ``--comm=mode`` and buffers of array module ``xp``,
    at most ``nbytes`` of them summed per iteration, sent as ``dtype``
    (``--comm_dtype``; collective: every rank must call it, with the same
    arguments)."""
    check_comm_mode(mode)
    compressor = make_compressor(dtype)
    if world.size == 1:
        return LocalTransport()
    if compressor is not None:
        return _compressed(world, mode, xp, nbytes, compressor)
    if xp is np:
        if mode == "nccl":
            raise CaffeError("--comm=nccl needs GPU nets (--gpu)")
        if mode in ("auto", "shm", "hierarchical"):
            return _by_host(world, mode, nbytes)
        return HOST_TRANSPORTS[mode](world)
    if mode in ("shm", "hierarchical"):
        raise CaffeError("--comm=%s needs CPU nets (GPU nets: nccl, or overlap through pinned host copies)"
                         % mode)
    from . import nccl, staged
    if mode in ("auto", "nccl"):
        reason = nccl.nccl_unavailable_reason(world)
        if reason is None:
            return nccl.NCCLTransport(world)
        if mode == "nccl":
            raise CaffeError("--comm=nccl: %s" % reason)
        if world.rank == 0:
            log.warning("NCCL not used (%s): gradients go through host memory and MPI", reason)
        mode = "overlap"
    return staged.StagedTransport(HOST_TRANSPORTS[mode](world))


def _compressed(world, mode, xp, nbytes, compressor):
    """The transport of ``mode`` whose sums add ``compressor``'s pieces
    (collective), or a CaffeError saying why ``mode`` cannot."""
    flag = "--comm_dtype=%s" % compressor.name
    if xp is not np:
        raise CaffeError("%s needs CPU nets" % flag)
    if mode == "nccl":
        raise CaffeError("%s cannot go with --comm=nccl: NCCL's reductions cannot add %s pieces in float32 "
                         "(and it needs GPU nets)" % (flag, compressor.name))
    threaded = mode == "thread"
    if mode in ("auto", "shm", "hierarchical"):
        host, one_host, crowded = _host_layout(world)
        if mode == "hierarchical" or (mode == "auto" and crowded and not one_host):
            return HierarchicalTransport(world, host, compressor)
        if mode == "shm" and one_host:
            transport = make_shm_transport(world, host, nbytes, asked=True, compressor=compressor)
            if transport is not None:
                return transport
        else:
            host.Free()
            if mode == "shm" and world.rank == 0:
                log.warning("--comm=shm: the ranks are on more than one host; using --comm=overlap")
        # auto on one host: the polled exchange (shm would save no bytes)
        threaded = mode == "auto" and _comm_thread_fits(world, one_host, crowded)
    return ExchangeTransport(world, compressor, comm_thread=threaded, blocking=mode == "blocking")


def make_chained_transport(world, compressor=None):
    """Polled sums whose handles (chained.Chain) set ``done`` once each is
    in, through ``compressor`` where there is one (collective).  Polled
    also across hosts: the plug-ins' sums are a few KB, and a communication
    thread for each cost more on the ranks' cores than it saved
    (docs/design/parallel.md)."""
    if compressor is not None:
        return ExchangeTransport(world, compressor)
    return IallreduceChains(world)


def _host_layout(world):
    """(this host's ranks as a communicator, all ranks on one host, some
    host has several ranks); collective."""
    host = world.comm.Split_type(world.MPI.COMM_TYPE_SHARED, key=world.rank)
    crowded = world.allreduce_scalars([host.size], "max", "the count of ranks per host")[0] > 1
    return host, host.size == world.size, crowded


def _comm_thread_fits(world, one_host, crowded):
    """auto's rule for a communication thread: one rank a host on several
    hosts, where MPI allows it (polled sums progress too slowly over TCP;
    on one host a thread's blocking calls would spin on a core the ranks
    compute on: docs/design/parallel.md)."""
    return not one_host and not crowded and world.thread_level >= world.MPI.THREAD_MULTIPLE


def _by_host(world, mode, nbytes):
    """auto, shm and hierarchical: the choice by where the ranks are
    (collective; every rank reaches the same one)."""
    host, one_host, crowded = _host_layout(world)
    if one_host and mode in ("auto", "shm"):
        transport = make_shm_transport(world, host, nbytes, asked=mode == "shm")
        return transport or HOST_TRANSPORTS["overlap"](world)
    if mode == "hierarchical" or (mode == "auto" and crowded and not one_host):
        return HierarchicalTransport(world, host)
    host.Free()
    if mode == "shm" and world.rank == 0:
        log.warning("--comm=shm: the ranks are on more than one host; using --comm=overlap")
    if mode == "auto" and _comm_thread_fits(world, one_host, crowded):
        return HOST_TRANSPORTS["thread"](world)
    return HOST_TRANSPORTS["overlap"](world)
