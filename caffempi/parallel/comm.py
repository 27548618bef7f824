"""The MPI world of this process, imported lazily.

``get_world()`` returns a :class:`World`: under ``mpirun``/``mpiexec`` (the
launcher's environment says so) an :class:`MPIWorld` over mpi4py's
``COMM_WORLD``; otherwise, or when ``CAFFEMPI_MPI=0``, a :class:`SingleWorld`
whose collectives return their input, so a machine without an MPI runtime
(or without mpi4py) trains on one process.  ``CAFFEMPI_MPI=1`` forces MPI
initialisation even when no launcher variable is visible.

Only caffempi.parallel talks to MPI; layers and solvers never do.
"""
import contextlib
import os
import sys
import time
from abc import ABC, abstractmethod

import numpy as np

from .. import config
from ..common import CaffeError
from .watchdog import DEFAULT_TIMEOUT, Watchdog

# Environment variables that launchers set in every rank (MPICH/Hydra,
# Intel MPI, Open MPI, PMIx, MVAPICH).  Their presence means "we were started
# by an MPI launcher": then MPI is required and imported.
_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE",
              "MPI_LOCALNRANKS")
_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")

# MPICH (the ch4 device's POSIX shared memory) keeps its intra-host
# segment in a file of this name until MPI_Finalize
_MPICH_SHM_FILE = "/dev/shm/mpich_shm_"

_world = None


def launched_by_mpi(environ=None):
    """True when an MPI launcher started this process (or CAFFEMPI_MPI=1);
    ``environ``: another environment to judge instead of this process's."""
    env = os.environ if environ is None else environ
    forced = (config.settings if environ is None else config.read(environ)).mpi
    if forced is not None:
        return forced
    return any(v in env for v in _SIZE_VARS + _RANK_VARS)


def _first_int(env, names):
    """The value of the first of ``names`` set to an integer in ``env``."""
    for v in names:
        try:
            return int(env[v])
        except (KeyError, ValueError):
            pass
    return None


def launcher_rank(environ=None):
    """This process's rank as its launcher's environment gives it (no MPI
    import), or None outside a job of several ranks."""
    env = os.environ if environ is None else environ
    if (_first_int(env, _SIZE_VARS) or 1) < 2:
        return None
    return _first_int(env, _RANK_VARS)


class PendingScalars:
    """A sum of scalars that may still be in flight: ``result()`` waits
    for it (once) and returns its float64 array."""

    def __init__(self, values, wait=None):
        self._values, self._wait = values, wait

    def result(self):
        if self._wait is not None:
            self._wait()
            self._wait = None
        return self._values


class World(ABC):
    """The ranks of a job and the collectives on host buffers that the
    parallel package builds on.  Every rank calls each collective in the
    same order; ``what`` describes a collective's purpose for the watchdog's
    message (:meth:`watch`)."""
    rank = 0
    size = 1
    is_mpi = False
    comm = None          # the mpi4py communicator, None without MPI
    MPI = None           # the mpi4py.MPI module, None without MPI
    started = False      # rank.start_rank ran: logging, abort handlers, cores set up

    @property
    def is_root(self):
        return self.rank == 0

    def watch(self, what, detail=None):
        """A context for a wait on the other ranks (``--comm_timeout``: see
        :mod:`caffempi.parallel.watchdog`); one process waits for nobody."""
        return contextlib.nullcontext()

    def waited_seconds(self):
        """Seconds this rank has spent in :meth:`watch` so far (one process: none)."""
        return 0.0

    def set_comm_timeout(self, seconds):
        """No wait on the other ranks may last longer than ``seconds``."""

    @abstractmethod
    def barrier(self, what="a barrier"):
        """Return when every rank has called it."""

    @abstractmethod
    def bcast(self, obj, root=0, what="a broadcast"):
        """``root``'s picklable ``obj`` on every rank."""

    @abstractmethod
    def bcast_array(self, arr, root=0, what="an array broadcast"):
        """Overwrite ``arr`` (contiguous; NumPy or CuPy) with ``root``'s; returns it."""

    @abstractmethod
    def allreduce_sum(self, arr, what="an array sum"):
        """In-place sum over ranks of a contiguous array; returns it."""

    @abstractmethod
    def allreduce_scalars(self, values, op="sum", what="a sum of scalars"):
        """Element-wise sum, max or min over ranks of a list of floats, as a
        float64 array."""

    def start_allreduce_scalars(self, values, op="sum", what="a sum of scalars"):
        """:meth:`allreduce_scalars` started, not waited for: a
        :class:`PendingScalars` whose ``result()`` waits and returns the
        array, so that a rank does not wait at the start while the others
        catch up.  Here the sum at once."""
        return PendingScalars(self.allreduce_scalars(values, op, what))

    @abstractmethod
    def allgather(self, obj, what="an allgather"):
        """Every rank's picklable ``obj``, in rank order, on every rank."""

    @abstractmethod
    def gather(self, obj, root=0, what="a gather"):
        """Every rank's ``obj`` in rank order on ``root``, None elsewhere."""

    @abstractmethod
    def scatter(self, objs, root=0, what="a scatter"):
        """Rank r's item of ``root``'s list ``objs`` (one per rank; ignored
        on the other ranks), on rank r."""

    @abstractmethod
    def abort(self, code=1):
        """End every rank of the job now with exit status ``code``; never returns."""

    @abstractmethod
    def processor_name(self):
        """The name of this rank's host."""

    @abstractmethod
    def local_rank(self):
        """(rank, size) among the ranks on this host."""

    @abstractmethod
    def library_version(self):
        """The MPI library, in one line."""


class SingleWorld(World):
    """One process, no MPI: every collective returns its input."""

    def barrier(self, what="a barrier"):
        pass

    def bcast(self, obj, root=0, what="a broadcast"):
        return obj

    def bcast_array(self, arr, root=0, what="an array broadcast"):
        return arr

    def allreduce_sum(self, arr, what="an array sum"):
        return arr

    def allreduce_scalars(self, values, op="sum", what="a sum of scalars"):
        return np.asarray(values, np.float64).copy()

    def allgather(self, obj, what="an allgather"):
        return [obj]

    def gather(self, obj, root=0, what="a gather"):
        return [obj]

    def scatter(self, objs, root=0, what="a scatter"):
        return objs[0]

    def abort(self, code=1):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def processor_name(self):
        import socket
        return socket.gethostname()

    def local_rank(self):
        return 0, 1

    def library_version(self):
        return "no MPI (single process)"


class MPIWorld(World):
    """COMM_WORLD through mpi4py (host buffers); every collective under the
    watchdog (``set_comm_timeout``; DEFAULT_TIMEOUT until then)."""
    is_mpi = True

    def __init__(self, MPI, comm=None):
        self.MPI = MPI
        self.comm = comm or MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.thread_level = MPI.Query_thread()
        self.watchdog = Watchdog(self.rank, DEFAULT_TIMEOUT, self.abort)

    def set_comm_timeout(self, seconds):
        """No collective may wait longer than ``seconds`` (0 or None: forever)."""
        waited = self.watchdog.waited
        self.watchdog = Watchdog(self.rank, seconds, self.abort)
        self.watchdog.waited = waited

    def watch(self, what, detail=None):
        return self.watchdog.watch(what, detail)

    def waited_seconds(self):
        return self.watchdog.waited

    def barrier(self, what="a barrier"):
        with self.watch(what):
            self.comm.Barrier()

    def bcast(self, obj, root=0, what="a broadcast"):
        with self.watch(what):
            return self.comm.bcast(obj, root=root)

    def bcast_array(self, arr, root=0, what="an array broadcast"):
        if arr.size:
            with self.watch(what), _host(arr) as h:
                self.comm.Bcast(h, root=root)
        return arr

    def allreduce_sum(self, arr, what="an array sum"):
        if arr.size:
            with self.watch(what), _host(arr) as h:
                self.comm.Allreduce(self.MPI.IN_PLACE, h, op=self.MPI.SUM)
        return arr

    def allreduce_scalars(self, values, op="sum", what="a sum of scalars"):
        a = np.array(values, np.float64).reshape(-1)
        if a.size:
            with self.watch(what):
                self.comm.Allreduce(self.MPI.IN_PLACE, a, op=self._op(op))
        return a

    def start_allreduce_scalars(self, values, op="sum", what="a sum of scalars"):
        a = np.array(values, np.float64).reshape(-1)
        if not a.size:
            return PendingScalars(a)
        with self.watch(what):
            request = self.comm.Iallreduce(self.MPI.IN_PLACE, a, op=self._op(op))
        return PendingScalars(a, lambda: self._wait(request, what))

    def _op(self, op):
        return {"sum": self.MPI.SUM, "max": self.MPI.MAX, "min": self.MPI.MIN}[op]

    def _wait(self, request, what):
        with self.watch(what):
            request.Wait()

    def allgather(self, obj, what="an allgather"):
        with self.watch(what):
            return self.comm.allgather(obj)

    def gather(self, obj, root=0, what="a gather"):
        with self.watch(what):
            return self.comm.gather(obj, root=root)

    def scatter(self, objs, root=0, what="a scatter"):
        with self.watch(what):
            return self.comm.scatter(objs, root=root)

    def abort(self, code=1):
        sys.stdout.flush()
        sys.stderr.flush()
        # give the launcher a moment to forward this rank's last output
        # before MPI_Abort makes it kill every rank
        time.sleep(0.3)
        try:
            self.comm.Abort(code)
        finally:  # Abort does not return; belt and braces
            os._exit(code)

    def processor_name(self):
        return self.MPI.Get_processor_name()

    def local_rank(self):
        """(rank, size) in the shared-memory split of COMM_WORLD: the ranks
        on this host, as MPI sees them (one GPU per local rank)."""
        if not hasattr(self, "_local"):
            self.join_host()
        return self._local

    def join_host(self):
        """Meet the other ranks of this host (collective): learns the local
        rank, and unlinks MPICH's shared-memory file once every rank here has
        mapped it.  MPICH unlinks it only in MPI_Finalize, so a job that was
        killed (a scheduler's SIGKILL, a crashed rank, MPI_Abort after a
        rank's error) left it in /dev/shm: memory taken until the host
        reboots, 2 MB a job for 2 ranks and more with more ranks per host.
        The ranks keep their mappings, and MPI_Finalize does not mind that
        the name is gone."""
        node = self.comm.Split_type(self.MPI.COMM_TYPE_SHARED)
        try:
            self._local = (node.Get_rank(), node.Get_size())
            node.Barrier()          # every rank here is past MPI_Init: all have mapped it
            if node.Get_rank() == 0:
                for path in mapped_files(_MPICH_SHM_FILE):
                    try:
                        os.unlink(path)
                    except OSError:
                        pass
        finally:
            node.Free()

    def library_version(self):
        return self.MPI.Get_library_version().strip().splitlines()[0]


def mapped_files(prefix, maps="/proc/self/maps"):
    """Paths starting with ``prefix`` of the files that this process maps
    and that still have their name (none where /proc is not Linux's)."""
    paths = set()
    try:
        with open(maps) as f:
            for line in f:
                fields = line.rstrip("\n").split(None, 5)
                if len(fields) == 6 and fields[5].startswith(prefix) and not fields[5].endswith(" (deleted)"):
                    paths.add(fields[5])
    except OSError:
        pass
    return sorted(paths)


@contextlib.contextmanager
def _host(arr):
    """A contiguous host array for an MPI call on ``arr``: the array itself,
    or for a device (CuPy) array a host copy that is copied back after."""
    if isinstance(arr, np.ndarray):
        if not (arr.flags.c_contiguous or arr.flags.f_contiguous):
            raise TypeError("MPI needs a contiguous array")
        yield arr
        return
    h = arr.get()
    yield h
    arr.set(h)


def get_world(comm=None):
    """This process's world (created on first use; MPI imported only if needed).

    ``comm`` is the gradient mode (``--comm``), which the first call decides
    for the process's MPI: ``thread``, and ``auto`` (which takes it across
    hosts with one rank a host), need MPI_THREAD_MULTIPLE, since the
    communication thread calls MPI beside the main one; every other mode
    calls MPI from the main thread only (the data threads hand their errors
    to it) and asks for MPI_THREAD_FUNNELED, since under MULTIPLE MPICH
    takes a lock in every call.  (``async`` also needs MPICH's progress
    thread, an environment setting made before this: rank.init_process.)"""
    global _world
    if _world is not None:
        return _world
    if not launched_by_mpi():
        _world = SingleWorld()
        return _world
    try:
        import mpi4py
        mpi4py.rc.thread_level = "multiple" if comm in ("thread", "auto") else "funneled"
        from mpi4py import MPI
    except Exception as e:  # ImportError, or a broken MPI shared library
        n = _first_int(os.environ, _SIZE_VARS)
        if n is None or n > 1:
            raise CaffeError("started by an MPI launcher (%s ranks) but mpi4py cannot be loaded: %s; "
                             "install mpi4py (pip install mpi4py mpich) or run without mpirun"
                             % (n if n is not None else "?", e))
        _world = SingleWorld()
        return _world
    world = MPIWorld(MPI)
    n = _first_int(os.environ, _SIZE_VARS)
    if n is not None and n != world.size:
        # an mpiexec of one MPI with mpi4py on another: each process would
        # init alone and train (and snapshot) as its own single rank
        raise CaffeError("the launcher started %d ranks but MPI sees %d: mpiexec and the MPI library "
                         "that mpi4py loads (%s) differ; use that MPI's mpiexec, or point mpi4py at "
                         "the launcher's library (MPI4PY_LIBMPI=/path/to/libmpi.so)"
                         % (n, world.size, world.library_version()))
    world.join_host()
    _world = world
    return _world


def current_world():
    """The world if one was made in this process, else None (never creates one)."""
    return _world
