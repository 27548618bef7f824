"""The collective watchdog (``--comm_timeout``): no rank waits forever.

A rank whose peer died, or whose host lost its link, would otherwise block
in its next collective for good: MPI over TCP notices nothing until the
kernel gives up on the connection, which can take many minutes or never
happen.  So every collective a rank makes (gradient buckets, agreements,
broadcasts, barriers) runs under :meth:`Watchdog.watch`, which records what
the rank waits for and since when; a daemon thread, woken once a second,
finds a wait older than the timeout, prints one line naming it, and ends the
job: ``MPI_Abort`` (which lets the launcher end the other ranks), and, if
that cannot reach the others and does not return, this process exits by
itself a few seconds later.  Like NCCL's watchdog, and Horovod's stall
inspector, it costs the waiting rank nothing: a clock read and a few
attribute writes per collective.  It also adds up the seconds a rank waited
(:attr:`Watchdog.waited`), which the batch shares subtract from an
iteration to find what the rank itself worked.
"""
import contextlib
import os
import sys
import threading
import time

DEFAULT_TIMEOUT = 600.0        # seconds, as NCCL's watchdog
ABORT_GRACE = 5.0              # seconds MPI_Abort gets before the process exits alone


class Watchdog:
    """Watches one rank's collectives; ``timeout`` seconds (None or <= 0: off).
    ``abort(code)`` ends the job (the world's MPI_Abort)."""

    def __init__(self, rank, timeout, abort, stream=None):
        self.rank = rank
        self.timeout = float(timeout) if timeout and timeout > 0 else None
        self._abort = abort
        self._stream = stream
        self._what = None          # (description, detail callable or None)
        self._since = None
        self._thread = None
        self.fired = False
        #: seconds spent in watched waits so far (the batch shares' measure of a rank's own work)
        self.waited = 0.0

    @contextlib.contextmanager
    def watch(self, what, detail=None):
        """Run the block as a wait for ``what`` (a description for the
        message); ``detail()``, if given, says which ranks have not joined."""
        if self._since is not None:      # inside a watched wait
            yield
            return
        if self.timeout is not None and self._thread is None:
            self._start()
        self._what, self._since = (what, detail), time.monotonic()
        try:
            yield
        finally:
            self.waited += time.monotonic() - self._since
            self._since = None

    def _start(self):
        self._thread = threading.Thread(target=self._run, name="caffempi-watchdog", daemon=True)
        self._thread.start()

    def _run(self):
        period = min(1.0, self.timeout / 4)
        while True:
            time.sleep(period)
            since, what = self._since, self._what
            if since is None:
                continue
            waited = time.monotonic() - since
            if waited > self.timeout and since == self._since:
                self._fire(what, waited)
                return

    def _fire(self, what, waited):
        self.fired = True
        description, detail = what
        missing = "not known"
        if detail is not None:
            try:
                ranks = detail()
                if ranks:
                    missing = ", ".join(map(str, ranks))
            except Exception:
                pass
        msg = ("caffempi: error: rank %d waited %.0f s for %s (ranks not joined: %s; a rank or its host's "
               "link may be down); ending the job (--comm_timeout=%g)"
               % (self.rank, waited, description, missing, self.timeout))
        stream = self._stream or sys.stderr
        try:
            stream.write(msg + "\n")
            stream.flush()
        except Exception:
            os.write(2, (msg + "\n").encode())
        # MPI_Abort may itself hang when the others cannot be reached: exit alone then
        threading.Thread(target=self._abort, args=(1,), name="caffempi-abort", daemon=True).start()
        time.sleep(ABORT_GRACE)
        os._exit(1)
