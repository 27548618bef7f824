"""Threaded batch prefetching for the data layers (Caffe's prefetch threads).

Per data layer and rank: one *producer* thread walks the source in stream
order (the database cursor, the image list, ...) and hands each batch's raw
records to a small pool of *worker* threads (``config.settings.data_workers``:
CAFFEMPI_DATA_WORKERS, default 2) that decode and transform them.  Finished
batches come out in order through a bounded queue of ``prefetch`` batches.

Stopping: every blocking call uses a short timeout and checks a stop event;
threads are daemons and every live prefetcher is stopped at exit.  An error in
any thread is stored in the batch it was working on (or in an error batch) and
re-raised in the main thread by :meth:`BatchPrefetcher.next`, so nothing hangs.

Sharding (Caffe's multi-GPU rule, by stream position): with ``size`` ranks and
batch ``b``, global batch k (batch size·b of one process) is stream positions
``k·size·b`` to ``(k+1)·size·b - 1``.  Rank ``r``'s batch ``k`` holds those
≡ r (mod size), ``k·size·b + j·size + r`` for j = 0..b-1; or, with uneven
batch shares (``--balance``: rank r takes ``shares[r]`` records, summing to
size·b), the run of ``shares[r]`` positions after the lower ranks' runs.
Either way the ranks hold global batch k between them, each record once.
Position p is record ``(p + skip) mod N``: key order, wrapping to the start.
"""
import atexit
import queue
import threading
import time
import weakref

from .. import config
from ..backend import denormals
from ..common import CaffeError, log

_POLL = 0.05
_live = weakref.WeakSet()


def shard_columns(batch_size, rank=0, size=1, shares=None):
    """Rank ``rank``'s places in a global batch of ``size``·``batch_size``
    records (a slice): every size-th from ``rank``, or with ``shares`` (a
    count a rank) its contiguous run, which keeps a share's records
    together when the shares change."""
    if shares is None:
        return slice(rank, size * batch_size, size)
    start = sum(shares[:rank])
    return slice(start, start + shares[rank])


def shard_positions(batch_index, batch_size, rank=0, size=1, shares=None):
    """Stream positions of rank ``rank``'s batch ``batch_index``."""
    base = batch_index * size * batch_size
    return [base + j for j in range(size * batch_size)[shard_columns(batch_size, rank, size, shares)]]


class _Slot:
    __slots__ = ("index", "done", "result", "error")

    def __init__(self, index):
        self.index = index
        self.done = threading.Event()
        self.result = None
        self.error = None


class _Stop(Exception):
    pass


class BatchPrefetcher:
    """Ordered, bounded, threaded batch pipeline.

    ``produce(start_batch, stopped)`` is a generator run in the producer thread
    that yields ``(batch_index, payload)`` in order (``stopped()`` tells it to
    quit); ``process(batch_index, payload)`` runs in a worker and returns the
    batch.  :meth:`next` returns the batches in order."""

    def __init__(self, name, produce, process, prefetch=4, workers=None):
        self.name = name
        self.produce = produce
        self.process = process
        self.prefetch = max(1, int(prefetch))
        self.workers = workers or config.settings.data_workers
        self._threads = []
        self._stop = None

    # --------------------------------------------------------------- control
    def start(self, batch_index=0):
        self.stop()
        self._stop = threading.Event()
        self._ready = queue.Queue(maxsize=self.prefetch)
        self._work = queue.Queue(maxsize=self.prefetch + self.workers)
        self._error = None
        stop = self._stop
        t = threading.Thread(target=self._producer, args=(batch_index, stop, self._ready, self._work),
                             name="%s-reader" % self.name, daemon=True)
        self._threads = [t]
        for i in range(self.workers):
            self._threads.append(threading.Thread(target=self._worker, args=(stop, self._work),
                                                  name="%s-worker%d" % (self.name, i), daemon=True))
        for t in self._threads:
            t.start()
        _live.add(self)

    def stop(self, timeout=2.0):
        """Stop and join the threads (they poll the stop event)."""
        if self._stop is None:
            return
        self._stop.set()
        deadline = time.time() + timeout
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.time()))
        self._threads = []
        self._stop = None
        _live.discard(self)

    @property
    def running(self):
        return self._stop is not None

    def __del__(self):
        try:
            if self._stop is not None:
                self._stop.set()
        except Exception:
            pass

    # --------------------------------------------------------------- threads
    @staticmethod
    def _put(q, item, stop):
        while True:
            if stop.is_set():
                raise _Stop()
            try:
                q.put(item, timeout=_POLL)
                return
            except queue.Full:
                continue

    def _producer(self, start, stop, ready, work):
        slot = None
        try:
            for index, payload in self.produce(start, stop.is_set):
                if stop.is_set():
                    return
                slot = _Slot(index)
                self._put(ready, slot, stop)
                self._put(work, (slot, payload), stop)
                slot = None
        except _Stop:
            return
        except BaseException as e:   # surfaces in the main thread
            err = _Slot(-1)
            err.error = e
            err.done.set()
            if slot is not None:          # the slot already queued never gets a result
                slot.error = e
                slot.done.set()
                return
            try:
                self._put(ready, err, stop)
            except _Stop:
                pass

    def _worker(self, stop, work):
        denormals.apply_here()
        while not stop.is_set():
            try:
                slot, payload = work.get(timeout=_POLL)
            except queue.Empty:
                continue
            try:
                slot.result = self.process(slot.index, payload)
            except BaseException as e:
                slot.error = e
            slot.done.set()

    # ------------------------------------------------------------ consumer
    def next(self):
        """The next batch in order (blocks; re-raises a thread's error)."""
        if self._stop is None:
            raise CaffeError("%s: reader is not running" % self.name)
        while True:
            try:
                slot = self._ready.get(timeout=_POLL)
                break
            except queue.Empty:
                if not self._threads[0].is_alive() and self._ready.empty():
                    self.stop()
                    raise CaffeError("%s: the reader thread ended without a batch" % self.name)
        while not slot.done.wait(_POLL):
            if not any(t.is_alive() for t in self._threads[1:]):
                self.stop()
                raise CaffeError("%s: the decode threads ended without finishing a batch" % self.name)
        if slot.error is not None:
            self.stop()
            e = slot.error
            if isinstance(e, CaffeError):
                raise CaffeError(str(e)) from None
            raise CaffeError("%s: error in reader thread: %s: %s" % (self.name, type(e).__name__, e)) from e
        return slot.result


def stop_all():
    for p in list(_live):
        try:
            p.stop(timeout=0.5)
        except Exception as e:  # pragma: no cover - best effort at exit
            log.debug("stopping %s: %s", p.name, e)


atexit.register(stop_all)


# ------------------------------------------------------------------ sources
def db_producer(db, batch_size, rank, size, skip, shuffled=None, shares_at=lambda k: None):
    """Producer for a database (:mod:`caffempi.data.db`, LMDB or LevelDB),
    yielding ``(k, [(key, value), ...])`` for this rank's batches from
    ``start`` on (:func:`shard_positions`, under the shares ``shares_at(k)``).  Stream position p is record p + skip, wrapping: epoch e
    = (p + skip) // num reads the records in key order, walking the cursor
    and stepping over other ranks' records without reading their values, or,
    when ``shuffled(e)`` gives (keys, permutation), record i of the epoch is
    the one with key keys[permutation[i]], read by seeking."""
    num = db.num

    def produce(start, stopped):
        with db.cursor() as cur:
            if not cur.first():
                raise CaffeError("%s: the database is empty" % db.path)
            at = 0                     # the cursor's record in key order; num: unknown
            order_epoch, order = None, None
            k = start
            while not stopped():
                recs = []
                for p in shard_positions(k, batch_size, rank, size, shares_at(k)):
                    epoch, i = divmod(p + skip, num)
                    if shuffled is not None and epoch != order_epoch:
                        order_epoch, order = epoch, shuffled(epoch)
                    if order is not None:
                        keys, permutation = order
                        key = keys[permutation[i]]
                        if not cur.set_key(key):
                            raise CaffeError("%s: key %r disappeared from the database" % (db.path, key))
                        at = num
                        recs.append((key, cur.value()))
                        continue
                    if i < at:
                        cur.first()
                        at = 0
                    while at < i:
                        if not cur.next():
                            raise CaffeError("%s: the database has fewer records than its %d entries"
                                             % (db.path, num))
                        at += 1
                    recs.append((cur.key(), cur.value()))
                yield k, recs
                k += 1
    return produce
