"""Batch shares by speed (``--balance=off|auto|B0:B1:...``): a synchronous
step that does not wait for its slowest rank, with Caffe's global batch.

An iteration's global batch is a fixed set of N·b records.  Rank r may take
any count b_r of them (sum N·b) if its loss gradient is weighted by b_r / b
(``Net.set_batch_shares``; each loss layer says its weight through
``Layer.share_scale``): the mean over ranks is then the one-process gradient
of the same records, only the work is split by speed.  Nets whose layers mix
samples (BatchNorm on batch statistics, a loss normalised by this rank's own
count of valid labels) keep equal shares, and say why once.

``auto`` measures the seconds each rank works in each step: from an
iteration's start to the end of its backward, plus the last iteration's
from there to the end of its weight update, less the seconds the rank
waited in collectives (``World.waited_seconds``), so that work after
backward that does not shrink with the share (the sufficient factors'
products over every rank's rows, the update) weighs on the slower rank as
it does on the step, and what runs between iterations (tests, snapshots)
does not.  After ``warmup`` iterations, at the end of every iteration's
backward the ranks start an exchange of their seconds a record since the
last (one non-blocking sum of a vector with a slot a rank), and read it
at the next iteration's start: every rank has started it before the
sums, so reading it waits for no one, and the sums stay the step's one
point where a rank waits for the others (an exchange at the start of an
iteration, blocking, was a second one: it cost the step the ranks' skew
over the update).  Every rank smooths the exchanged
times the same way (``smoothing``: half the last iteration's, half the
estimate before) and derives the same new shares from them: counts
proportional to speed, in whole records (largest remainders), none below
``floor`` (b/10, at least 1).  Every iteration, because a rank's speed on
a shared machine persists from one step to the next but not for a second:
replaying per-step times measured on a shared 2-vCPU VM, shares from the
last step came within 2-3% of an oracle's, shares from the last 10 steps
gained almost nothing over equal ones, and the half-and-half estimate
beat the last step alone in 38 of 42 measured series, by 0.5 points on
average (docs/design/parallel.md).  ``auto:SECONDS`` decides instead
every period of about SECONDS of steps (at least ``shortest``
iterations; the first exchange only sets the period) from its throughput,
the seconds over the records of the whole period, which holds a CPU
quota's stalls.
New shares are announced to the net as many iterations ahead as its data
readers may have read (``Net.share_lookahead``), so that the readers read
them without a restart, and only where the predicted step (the slowest
rank's share times its seconds a record) is at least ``gain`` (2%)
shorter than the present one's: noise does not move them.  Proportional
shares converge to equal compute times, the synchronous step's optimum,
whatever each rank's fixed cost an iteration.

A fixed ``B0:B1:...`` takes those counts for the whole run (a cluster whose
speeds are known, and the tests).  The shares in effect and those announced,
the period and the position in it are in the snapshot (:meth:`state`), so
a resumed run reads the same records; later decisions depend on the
measured times, as they would.
"""
import math
import time

from ..common import AgreedError, CaffeError, log

BALANCE_MODES = ("off", "auto")


def parse_balance(text):
    """(mode, counts, interval) of a --balance value: ('off', None, None),
    ('auto', None, seconds or None for the default) or ('fixed', counts,
    None)."""
    text = str(text).strip()
    mode, _, seconds = text.partition(":")
    if mode in BALANCE_MODES and not seconds:
        return mode, None, None
    try:
        if mode == "auto":
            interval = float(seconds)
            if interval > 0:
                return "auto", None, interval
        else:
            counts = tuple(int(n) for n in text.split(":"))
            if len(counts) >= 2 and min(counts) >= 1:
                return "fixed", counts, None
    except ValueError:
        pass
    raise CaffeError("--balance must be off, auto, auto:SECONDS (SECONDS > 0) or per-rank record counts "
                     "B0:B1:... (positive), got '%s'" % text)


def proportional_shares(total, seconds_per_record, floor=1):
    """Whole-record counts summing to ``total``, proportional to each rank's
    speed (1 / seconds per record) by largest remainders, none below
    ``floor``."""
    speed = [1.0 / max(s, 1e-12) for s in seconds_per_record]
    ideal = [total * v / sum(speed) for v in speed]
    counts = [max(floor, int(math.floor(x))) for x in ideal]
    order = sorted(range(len(ideal)), key=lambda r: (counts[r] - ideal[r], r))
    k = 0
    while sum(counts) < total:
        counts[order[k % len(order)]] += 1
        k += 1
    order = sorted(range(len(ideal)), key=lambda r: (ideal[r] - counts[r], r))
    k = 0
    while sum(counts) > total:
        r = order[k % len(order)]
        if counts[r] > floor:
            counts[r] -= 1
        k += 1
    return tuple(counts)


class ShareBalancer:
    """The batch shares of one training net (composed into the gradient
    sync, which calls :meth:`attach`, :meth:`before_iteration`,
    :meth:`after_update` and :meth:`detach` and keeps :meth:`state` in
    its own).  ``clock`` gives seconds, and ``waited`` the seconds this
    rank has waited in collectives so far (default: the world's
    ``waited_seconds``); a test may simulate both, on one time line."""

    #: the share of the step a change must save
    gain = 0.02
    #: iterations measured before the first exchange
    warmup = 5
    #: the fewest iterations a period of ``auto:SECONDS``
    shortest = 3

    #: seconds of steps between decisions (``auto:SECONDS``; None: every iteration)
    interval = None
    #: plain auto: the weight of the last iteration in each rank's estimate
    #: of its seconds a record, the rest the estimate before it (a period of
    #: ``auto:SECONDS`` is its own average: 1)
    smoothing = 0.5
    #: the fewest seconds between two of the log's share lines
    log_every = 1.0

    def __init__(self, mode="auto", clock=time.perf_counter, waited=None):
        self.mode, self.fixed, interval = parse_balance(mode)
        if interval is not None:
            self.interval, self.smoothing = interval, 1.0
        self.clock, self.waited = clock, waited
        self.world = None
        self.net = None
        self.shares = None
        self.batch = None
        self._why = None
        self._count = 0              # iterations begun since the last exchange
        self._period = self.warmup
        self._calibrated = self.interval is None     # the period is set (from measured steps, if periodic)
        self._window = []            # (seconds worked, records) of the iterations since the last decision
        self._estimate = None        # every rank's smoothed seconds a record at the last decision
        self._start = None           # (clock, seconds waited) at the start of this iteration
        self._backward_end = None    # (clock, seconds waited) at the end of this iteration's backward
        self._after_backward = None  # seconds the last iteration worked from its backward's end to its update's
        self._exchange = None        # the ranks' seconds a record, in flight since the last backward's end
        self._logged = None          # time.monotonic() at the last share line
        self._unlogged = None        # the step ms by rank before the last change, if not yet logged

    @property
    def active(self):
        return self.net is not None

    def attach(self, world, net):
        """Meet the net (on every rank; logs on rank 0 why shares stay equal
        where they must)."""
        self.world, self.net = world, None
        self._start = self._backward_end = self._after_backward = None     # no step half-measured on another net
        if self.mode == "off" or world.size < 2:
            return
        batch, why = net.shareable_batch()
        if self.fixed is not None:     # every rank built the same net: they all stop here, rank 0 says why
            if why is not None:
                raise AgreedError("--balance=%s: %s" % (":".join(map(str, self.fixed)), why))
            if len(self.fixed) != world.size or sum(self.fixed) != world.size * batch:
                raise AgreedError("--balance=%s: give %d counts summing to %d (%d ranks x batch %d)" % (
                    ":".join(map(str, self.fixed)), world.size, world.size * batch, world.size, batch))
        if why is not None:
            if world.rank == 0 and why != self._why:
                log.info("Batch shares: equal (--balance=auto): %s", why)
            self._why = why
            return
        self.net, self.batch = net, batch
        if self.fixed is not None:
            self.shares = self.fixed
            net.set_batch_shares(self.fixed)
        if world.rank == 0:
            log.info("Batch shares: %s (--balance=%s)", self._describe(), self.mode)

    def _describe(self):
        shares = self.shares or (self.batch,) * self.world.size
        return "%s of %d" % (" ".join(map(str, shares)), sum(shares))

    def before_iteration(self, iter_size=1):
        """At the start of an iteration: decide from the exchange started
        at the last one's backward end (collective; auto only).  New shares
        are announced to the net a whole number of iterations ahead, at
        least its readers' lookahead (``iter_size`` passes an iteration),
        so they take effect without a reader restart."""
        if self.net is None:
            return
        if self._exchange is not None:
            per_record, self._exchange = self._exchange.result(), None
            self._decide(list(per_record), iter_size)
        self._count += 1
        if self.fixed is None:     # fixed shares need no measures: none kept
            self._start = self._mark()

    def after_backward(self):
        """The iteration's last backward is done: its work so far and the
        last iteration's after its backward are one step's; on a period's
        last, start the exchange (collective; auto only)."""
        if self.net is None or self._start is None:
            return
        self._backward_end = self._mark()
        to_backward_end, self._start = _worked(self._start, self._backward_end), None
        if self._after_backward is not None:
            shares = self.net.batch_shares
            self._window.append((to_backward_end + self._after_backward,
                                 shares[self.world.rank] if shares else self.batch))
        if self._count >= self._period:
            self._exchange = self._start_exchange()

    def after_update(self):
        """The iteration's weights are updated: the seconds it worked after
        its backward, not waiting."""
        if self.net is None or self._backward_end is None:
            return
        self._after_backward = _worked(self._backward_end, self._mark())
        self._backward_end = None

    def detach(self):
        """Complete an exchange in flight (collective: every rank started
        it), as MPI wants no request left at the end."""
        if self._exchange is not None:
            self._exchange.result()
            self._exchange = None

    def _mark(self):
        return self.clock(), self._waited()

    def _waited(self):
        return (self.waited or self.world.waited_seconds)()

    def _start_exchange(self):
        """Every rank's seconds a record over the iterations since the last
        exchange (0: none measured), summed into its slot, not waited for."""
        mine = [0.0] * self.world.size
        if self._window:
            mine[self.world.rank] = sum(t for t, _ in self._window) / sum(n for _, n in self._window)
        self._window, self._count = [], 0
        return self.world.start_allreduce_scalars(mine, "sum", "the ranks' step times for the batch shares")

    def _decide(self, per_record, iter_size):
        current = self.shares or (self.batch,) * self.world.size
        if self.world.rank == 0:
            self._log_shares()
        if min(per_record) <= 0.0:
            self._estimate = None
            return
        if self._estimate is not None:
            per_record = [self.smoothing * t + (1.0 - self.smoothing) * e for t, e in zip(per_record, self._estimate)]
        self._estimate = per_record
        step_now = max(n * t for n, t in zip(current, per_record))
        self._period = 1 if self.interval is None else \
            max(self.shortest, min(1000, int(round(self.interval / step_now))))
        calibrated, self._calibrated = self._calibrated, True
        if not calibrated:
            return
        proposed = proportional_shares(sum(current), per_record, floor=max(1, self.batch // 10))
        step_new = max(n * t for n, t in zip(proposed, per_record))
        if proposed == current or step_new > step_now * (1.0 - self.gain):
            return
        self.shares = None if len(set(proposed)) == 1 else proposed
        ahead = -(-self.net.share_lookahead() // iter_size) * iter_size
        self.net.set_batch_shares(self.shares, ahead)
        if self.world.rank == 0:
            self._unlogged = " ".join("%.1f" % (1e3 * n * t) for n, t in zip(current, per_record))
            self._log_shares()

    def _log_shares(self):
        """Rank 0's line for the last change, at most one a ``log_every``
        seconds (a line for each iteration's change would bury the log):
        a change inside that time is logged at the first decision after it."""
        now = time.monotonic()
        if self._unlogged is None or (self._logged is not None and now - self._logged < self.log_every):
            return
        log.info("Batch shares: %s (step ms by rank: %s)", self._describe(), self._unlogged)
        self._logged, self._unlogged = now, None

    def state(self):
        """What a resumed run needs to read the same records (JSON): the
        shares in effect, those announced, and the place in the period."""
        if self.net is None:
            return None
        return {"shares": _json(self.net.batch_shares), "decided": _json(self.shares),
                "announced": [[ahead, _json(shares)] for ahead, shares in self.net.pending_batch_shares()],
                "count": self._count, "period": self._period, "calibrated": self._calibrated}

    def load_state(self, state):
        if self.net is None or not state:
            return
        self.detach()
        self.net.set_batch_shares(_tuple(state["shares"]))
        for ahead, shares in state["announced"]:
            self.net.set_batch_shares(_tuple(shares), ahead)
        self.shares = _tuple(state["decided"])
        self._count, self._period = int(state["count"]), int(state["period"])
        self._calibrated = bool(state["calibrated"])
        self._window, self._estimate = [], None


def _worked(since, until):
    """Seconds between two (clock, seconds waited) marks, less the waits."""
    return (until[0] - since[0]) - (until[1] - since[1])


def _json(shares):
    return None if shares is None else [int(n) for n in shares]


def _tuple(shares):
    return None if shares is None else tuple(int(n) for n in shares)
