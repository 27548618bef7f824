"""Process-wide state shared by layers, nets and solvers: phases, the random
generator (Caffe's Caffe::rng) and glog-style logging."""
import contextlib
import getpass
import logging
import os
import re
import socket
import sys
import threading
import time

import numpy as np

TRAIN = 0
TEST = 1


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


# ----------------------------------------------------------------- log text
# What a log line must not carry: C0 control characters but tab (newline is
# allowed only where a message is meant to span lines), DEL, C1 controls, and
# lone surrogates (os.fsdecode's stand-ins for undecodable bytes, which a
# UTF-8 log file cannot hold).
_UNPRINTABLE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f\ud800-\udfff]")
_UNPRINTABLE_BUT_NEWLINE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")


def _escape(match):
    return match.group().encode("unicode_escape").decode("ascii")


def printable(text, newlines=False):
    """``text`` made fit for a log line: a string from MPI, the OS or a user
    file (``bytes`` are decoded as UTF-8, anything else goes through str).

    Trailing NULs are removed: they are C string terminators that a length
    counted in (Open MPI's MPI_Get_library_version ends in one), not text,
    and one NUL makes grep call the whole log binary (BVLC's parse_log.sh
    then writes empty tables).  Every other control character but tab
    (newline too when ``newlines``) is escaped as Python writes it (``\\x00``,
    ``\\r``, ``\\x1b``, ``\\udcff``), not dropped: a path or host name in an
    error stays recognisable and two names never collapse into one."""
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", "backslashreplace")
    elif not isinstance(text, str):
        text = str(text)
    text = text.rstrip("\0")
    return (_UNPRINTABLE_BUT_NEWLINE if newlines else _UNPRINTABLE).sub(_escape, text)


# -------------------------------------------------------------------- logging
# glog's severities 0..3, as --minloglevel and --stderrthreshold number them
SEVERITY_LEVELS = (logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL)
SEVERITY_LETTERS = {logging.CRITICAL: "F", logging.ERROR: "E", logging.WARNING: "W"}


class GlogFormatter(logging.Formatter):
    """Formats records as glog does, so Caffe's log parsers read our logs:
    ``I1122 04:16:00.123456  1234 solver.py:123] message``.  Verbose
    (debug) records are written ``I``, as glog writes its VLOG lines."""

    prefix = ""

    def format(self, record):
        t = time.localtime(record.created)
        usec = int((record.created - int(record.created)) * 1e6)
        head = "%s%02d%02d %02d:%02d:%02d.%06d %5d %s:%d] " % (
            SEVERITY_LETTERS.get(record.levelno, "I"), t.tm_mon, t.tm_mday, t.tm_hour, t.tm_min, t.tm_sec,
            usec, threading.get_native_id(), os.path.basename(record.pathname), record.lineno)
        # every line is text whatever a message carries (printable: the
        # call sites escape newlines in single-line values themselves)
        return head + self.prefix + printable(record.getMessage(), newlines=True)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time of each record (as
    logging's last-resort handler), so a handler made while a test captured
    stderr does not keep writing into the closed capture."""

    def __init__(self):
        logging.Handler.__init__(self)

    @property
    def stream(self):
        return sys.stderr


log = logging.getLogger("caffempi")


class _LogSettings:
    """What glog's flags chose for this process (configure_logging)."""
    level = logging.INFO            # --minloglevel and --v: the least severe record logged
    stderr_level = logging.INFO     # the least severe record also written to stderr
    file_handler = None             # --log_dir's file
    stderr_handler = None


_settings = _LogSettings()


def add_logging_flags(define):
    """glog's flags, defined through a flag set's ``define``."""
    define("log_dir", "", "If specified, the log is also written to a file in this directory, named as "
           "glog names it: <program>.<host>.<user>.log.INFO.<yyyymmdd-hhmmss>.<pid>, with the link "
           "<program>.INFO to it; under MPI, rank r > 0 writes <program>.rank<r>.<host>... and "
           "<program>.rank<r>.INFO. No file without it.")
    define("logtostderr", False, "Log to stderr only, no file, even with --log_dir.")
    define("alsologtostderr", True, "Log to stderr as well as to the --log_dir file (on by default, as "
           "Caffe's programs set it); false: stderr gets the messages at or above --stderrthreshold only.")
    define("stderrthreshold", 2, "With --alsologtostderr=false: messages at or above this level are copied "
           "to stderr (0 INFO, 1 WARNING, 2 ERROR, 3 FATAL).")
    define("minloglevel", 0, "Log messages at or above this level (0 INFO, 1 WARNING, 2 ERROR, 3 FATAL).")
    define("v", 0, "Show verbose messages (glog's VLOG) too when above 0: caffempi has one verbose level, "
           "its debug messages (the net's per-layer set-up lines), written with glog's I.")


def _severity_level(name, value):
    if not 0 <= value < len(SEVERITY_LEVELS):
        raise CaffeError("--%s=%d: expected 0 (INFO), 1 (WARNING), 2 (ERROR) or 3 (FATAL)" % (name, value))
    return SEVERITY_LEVELS[value]


def _glog_file_name(program, rank=None, when=None):
    """glog's log file name, ``<program>.<host>.<user>.log.INFO.<yyyymmdd-hhmmss>.<pid>``;
    rank r > 0 of an MPI job inserts ``.rank<r>`` after the program, since
    every rank of a host would otherwise replace the one ``<program>.INFO``
    link.  Returns (file name, link name)."""
    base = program if not rank else "%s.rank%d" % (program, rank)
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "invalid-user"
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(when))
    return "%s.%s.%s.log.INFO.%s.%d" % (base, socket.gethostname(), user, stamp, os.getpid()), base + ".INFO"


def _open_log_file(log_dir, program, rank):
    """The --log_dir file's handler, its glog header written, the
    ``<program>.INFO`` link pointing at it (replaced as glog does)."""
    if not os.path.isdir(log_dir):
        raise CaffeError("--log_dir=%s: no such directory" % log_dir)
    now = time.time()
    name, link = _glog_file_name(program, rank, now)
    path = os.path.join(log_dir, name)
    try:
        handler = logging.FileHandler(path, encoding="utf-8")
    except OSError as e:
        raise CaffeError("--log_dir=%s: cannot create the log file %s: %s" % (log_dir, name, e.strerror or e)) \
            from None
    handler.stream.write("Log file created at: %s\nRunning on machine: %s\nRunning duration (h:mm:ss): 0:00:00\n"
                         "Log line format: [IWEF]mmdd hh:mm:ss.uuuuuu threadid file:line] msg\n"
                         % (time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(now)),
                            printable(socket.gethostname())))
    link_path = os.path.join(log_dir, link)
    try:
        if os.path.lexists(link_path):
            os.unlink(link_path)
        os.symlink(name, link_path)
    except OSError:
        pass            # as glog: the log goes on without its link
    return handler


def configure_logging(program, flags, rank=None):
    """Apply glog's flags (:func:`add_logging_flags`) to this process's
    logging, replacing an earlier call's file; ``rank``: this process's MPI
    rank, None outside a job.  caffempi logs to stderr by default, as
    Caffe's programs do (they set FLAGS_alsologtostderr), and writes a file
    only where --log_dir says (glog would write one to /tmp unasked)."""
    level = _severity_level("minloglevel", flags.minloglevel)
    threshold = _severity_level("stderrthreshold", flags.stderrthreshold)
    if flags.v < 0:
        raise CaffeError("--v=%d: expected 0 or more" % flags.v)
    if flags.v > 0 and level == logging.INFO:
        level = logging.DEBUG
    if _settings.file_handler is not None:
        log.removeHandler(_settings.file_handler)
        _settings.file_handler.close()
        _settings.file_handler = None
    _settings.level = level
    _settings.stderr_level = level if flags.logtostderr or flags.alsologtostderr else max(level, threshold)
    if flags.log_dir and not flags.logtostderr:
        handler = _open_log_file(flags.log_dir, program, rank)
        handler.setFormatter(GlogFormatter())
        handler.setLevel(level)
        log.addHandler(handler)
        _settings.file_handler = handler
    init_logging()


def init_logging(level=logging.NOTSET, prefix="", stream=None):
    """Send caffempi's log to stderr (or ``stream``) in glog's format, at the
    level glog's flags chose (:func:`configure_logging`) and at least
    ``level`` (ranks other than 0 show warnings and errors only), each line
    after the header starting with ``prefix``."""
    if _settings.stderr_handler is not None:
        log.removeHandler(_settings.stderr_handler)
    handler = _StderrHandler() if stream is None else logging.StreamHandler(stream)
    handler.setLevel(max(level, _settings.stderr_level))
    fmt = GlogFormatter()
    fmt.prefix = prefix
    handler.setFormatter(fmt)
    log.addHandler(handler)
    _settings.stderr_handler = handler
    log.setLevel(min(handler.level, _settings.level) if _settings.file_handler is not None else handler.level)
    log.propagate = False


@contextlib.contextmanager
def locally(local, name, value):
    """Inside the block, attribute ``name`` of the threading.local ``local``
    is ``value``; what it was (None where unset) is back after it, so
    blocks nest."""
    previous = getattr(local, name, None)
    setattr(local, name, value)
    try:
        yield
    finally:
        setattr(local, name, previous)


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
