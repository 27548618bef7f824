"""Intra-op threads for the NumPy kernels.

The convolution, pooling and product kernels of :mod:`caffempi.backend.cpu`
work in chunks (of images, or of rows of a product), the layers'
elementwise and per-channel passes in blocks (:mod:`.cpu.blocks`).
:func:`for_chunks` runs those chunks on T threads at once; NumPy releases the GIL in its
copies, ufuncs and matmul, so every thread runs copies and GEMMs.  T is the
BLAS library's thread count when caffempi first computes
(``OPENBLAS_NUM_THREADS`` or ``OMP_NUM_THREADS``, else one per core, as BLAS
itself decides; :func:`set_thread_count` changes it), and BLAS is then kept
at one thread for good: the chunked GEMMs are skinny and gain nothing from
BLAS's own threads, whose spinning workers would take cores from the chunks.

Between NumPy calls a thread needs the GIL, so chunks made of many short
calls scale badly: the convolution chunks (mostly GEMMs) gain most, the
pooling chunks little; pooling stays threaded as it still shortens a step.

The convolutions', poolings' and passes' chunks never depend on T, and
their partial sums are folded in chunk order (a pass sums each channel
within one block), so their results are bitwise the same for any thread
count (products split by :func:`cpu.matmul` may differ in the last bits;
see there).

:func:`progress` makes the calling thread call a function between the
chunks it runs, for the length of a ``with`` block: the solver runs backward
inside ``with threads.progress(sync.progress)`` so that pending gradient
sums progress inside a long layer (MPI moves a message only when called),
without the kernels knowing about MPI.  The function is the calling
thread's own (thread-local), so no other thread's kernels call it.

History and measurements: docs/design/cpu.md
"""
import os
import threading

from ..common import locally
from . import denormals

_threads = None       # T, once BLAS has been set to one thread
_pool = None          # the helper threads (_Helpers)
_region = threading.Lock()   # one parallel region at a time
_local = threading.local()
_init_lock = threading.Lock()


def thread_count():
    """T, the number of threads the kernels use.  On the first call it is
    read from the BLAS library, which is then set to one thread.  Each
    thread that calls it (every computing thread: the kernels and products
    do) flushes denormals from then on (:mod:`.denormals`)."""
    global _threads
    if not getattr(_local, "flushed", False):
        _local.flushed = True
        denormals.apply_here()
    if _threads is None:
        with _init_lock:
            if _threads is None:
                import numpy  # noqa: F401  (loads NumPy's BLAS, which threadpoolctl looks for)
                from threadpoolctl import ThreadpoolController
                blas = ThreadpoolController().select(user_api="blas")
                counts = [lib.get_num_threads() for lib in blas.lib_controllers]
                blas.limit(limits=1)
                _threads = max([1] + counts)
    return _threads


def set_thread_count(threads):
    """Sets T (at least 1); returns the previous value."""
    global _threads
    previous = thread_count()
    _threads = max(1, int(threads))
    return previous


def progress(fn):
    """A block inside which the calling thread calls ``fn()`` after each
    chunk it runs in :func:`for_chunks` (None: nothing); the previous
    function, if any, is back after it (blocks nest)."""
    return locally(_local, "progress", fn)


def progress_here():
    """The function the calling thread calls between chunks, or None."""
    return getattr(_local, "progress", None)


def poll():
    """Calls the calling thread's :func:`progress` function, if any: for a
    chunk body that runs long, between its own pieces (as
    :func:`for_chunks` calls it between chunks; helper threads have none)."""
    fn = progress_here()
    if fn is not None:
        fn()


class _Helpers:
    """T-1 helper threads, each handed a region's work through a lock of
    its own (released to start it, a second released when it is done):
    a region costs about a third of what a ThreadPoolExecutor's submit and
    wait did (docs/design/cpu.md, "Handing a region to the helpers")."""

    def __init__(self, count):
        self.count = count
        self.work = None
        self.failures = []
        self.start = [threading.Lock() for _ in range(count)]
        self.done = [threading.Lock() for _ in range(count)]
        for lock in self.start + self.done:
            lock.acquire()
        for i in range(count):
            threading.Thread(target=self._serve, args=(i,), name="caffempi-op-%d" % i, daemon=True).start()

    def _serve(self, i):
        denormals.apply_here()
        while True:
            self.start[i].acquire()
            try:
                self.work()
            except BaseException as e:       # handed to the region's caller
                self.failures.append(e)
            finally:
                self.done[i].release()

    def run(self, work, helpers, own):
        """``work()`` on ``helpers`` of the threads and ``own()`` on the
        caller at once; returns when all are done, raising the first
        failure."""
        self.work, self.failures = work, []
        for lock in self.start[:helpers]:
            lock.release()
        try:
            own()
        finally:
            for lock in self.done[:helpers]:
                lock.acquire()
            self.work = None
        if self.failures:
            raise self.failures[0]


def _helpers(threads):
    global _pool
    if _pool is None or _pool.count < threads - 1:
        _pool = _Helpers(threads - 1)     # a smaller one's threads stay parked
    return _pool


def _forget_pool():
    # a forked child has none of the parent's threads
    global _pool
    _pool = None


os.register_at_fork(after_in_child=_forget_pool)


def for_chunks(count, body, fold=None):
    """Calls ``body(i)`` for i in range(count), on up to T threads, and
    ``fold(result)`` on the results in index order (never two at once, and
    each result dropped once folded).  Runs serially where T is 1, inside
    another region, or while another thread holds one."""
    threads = min(count, thread_count())
    progress = progress_here()
    if threads <= 1 or getattr(_local, "inside", False) or not _region.acquire(blocking=False):
        for i in range(count):
            r = body(i)
            if fold is not None:
                fold(r)
            if progress is not None:
                progress()
        return
    try:
        _run(count, body, fold, threads, progress)
    finally:
        _region.release()


def _run(count, body, fold, threads, progress=None):
    lock = threading.Lock()
    state = {"next": 0, "folded": 0, "failed": False}
    pending = {}

    def work(progress=None):
        _local.inside = True
        try:
            while True:
                with lock:
                    i = state["next"]
                    if i >= count or state["failed"]:
                        return
                    state["next"] = i + 1
                try:
                    r = body(i)
                except BaseException:
                    state["failed"] = True
                    raise
                if fold is not None:
                    with lock:
                        pending[i] = r
                        while state["folded"] in pending:
                            fold(pending.pop(state["folded"]))
                            state["folded"] += 1
                if progress is not None:
                    progress()
        finally:
            _local.inside = False

    _helpers(threads).run(work, threads - 1, lambda: work(progress))
