"""Process-wide state shared by layers, nets and solvers: phases, the random
generator (Caffe's Caffe::rng) and glog-style logging."""
import contextlib
import logging
import os
import sys
import threading
import time

import numpy as np

TRAIN = 0
TEST = 1
PHASE_NAMES = {TRAIN: "TRAIN", TEST: "TEST"}


class CaffeError(Exception):
    """An error reported to the user as one line (no traceback unless --debug)."""


class AgreedError(CaffeError):
    """A CaffeError that every rank raises at the same point of the loop (after
    agreeing on it through the collectives): rank 0 reports it and every rank exits
    normally, with no MPI_Abort."""


class SolverAction:
    """What a signal asks of the solver (Caffe's SolverAction::Enum, and
    SNAPSHOT_AND_STOP: SIGTERM's "snapshot", since a preempted job must exit)."""
    NONE = 0
    STOP = 1
    SNAPSHOT = 2
    SNAPSHOT_AND_STOP = 3

    @staticmethod
    def from_name(name, then_stop=False):
        """The action of a ``--sig*_effect`` value; ``then_stop``: "snapshot"
        also stops (SIGTERM)."""
        try:
            action = {"none": SolverAction.NONE, "stop": SolverAction.STOP,
                      "snapshot": SolverAction.SNAPSHOT}[name]
        except KeyError:
            raise CaffeError("invalid signal effect '%s' (stop, snapshot or none)" % name)
        return SolverAction.SNAPSHOT_AND_STOP if then_stop and action == SolverAction.SNAPSHOT else action

    @staticmethod
    def snapshots(action):
        return action in (SolverAction.SNAPSHOT, SolverAction.SNAPSHOT_AND_STOP)

    @staticmethod
    def stops(action):
        return action in (SolverAction.STOP, SolverAction.SNAPSHOT_AND_STOP)


# --------------------------------------------------------------------- random
_rng = np.random.RandomState(1701)


def set_random_seed(seed):
    """Seed every random draw of this process (fillers, dropout, shuffles)."""
    global _rng
    _rng = np.random.RandomState(int(seed) % (2 ** 32))


def rank_seed(seed, rank):
    """The seed of rank ``rank``'s process random state when the solver's
    random_seed is ``seed``: the one per-rank rule (ranks draw different
    dropout masks; a resume on as many ranks reproduces them)."""
    return int(seed) + int(rank)


def rng():
    return _rng


def get_rng_state():
    return _rng.get_state()


def set_rng_state(state):
    _rng.set_state(state)


# -------------------------------------------------------------------- logging
class GlogFormatter(logging.Formatter):
    """Formats records as glog does, so Caffe's log parsers read our logs:
    ``I1122 04:16:00.123456  1234 solver.py:123] message``."""

    prefix = ""

    def format(self, record):
        t = time.localtime(record.created)
        usec = int((record.created - int(record.created)) * 1e6)
        level = record.levelname[0] if record.levelname != "CRITICAL" else "F"
        head = "%s%02d%02d %02d:%02d:%02d.%06d %5d %s:%d] " % (
            level, t.tm_mon, t.tm_mday, t.tm_hour, t.tm_min, t.tm_sec, usec,
            threading.get_native_id(),
            os.path.basename(record.pathname), record.lineno)
        return head + self.prefix + record.getMessage()


log = logging.getLogger("caffempi")
_handler = None


def init_logging(level=logging.INFO, prefix="", stream=None):
    """Send caffempi's log to stderr (as glog does) in glog's format."""
    global _handler
    if _handler is not None:
        log.removeHandler(_handler)
    _handler = logging.StreamHandler(stream or sys.stderr)
    fmt = GlogFormatter()
    fmt.prefix = prefix
    _handler.setFormatter(fmt)
    log.addHandler(_handler)
    log.setLevel(level)
    log.propagate = False


@contextlib.contextmanager
def captured_log(level=logging.INFO):
    """Collect the messages caffempi logs inside the block (a list)."""
    messages = []
    handler = logging.Handler(level)
    handler.emit = lambda record: messages.append(record.getMessage())
    old_level = log.level
    log.addHandler(handler)
    log.setLevel(min(level, old_level or level))
    try:
        yield messages
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
