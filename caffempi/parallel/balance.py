"""Batch shares by speed (``--balance=off|auto|B0:B1:...``): a synchronous
step that does not wait for its slowest rank, with Caffe's global batch.

An iteration's global batch is a fixed set of N·b records.  Rank r may take
any count b_r of them (sum N·b) if its loss gradient is weighted by b_r / b
(``Net.set_batch_shares``; each loss layer says its weight through
``Layer.share_scale``): the mean over ranks is then the one-process gradient
of the same records, only the work is split by speed.  Nets whose layers mix
samples (BatchNorm on batch statistics, a loss normalised by this rank's own
count of valid labels) keep equal shares, and say why once.

``auto`` measures each rank's compute seconds an iteration (from the start
of the iteration to the gradient sync's wait), and every *period* of
iterations the ranks all-gather the medians of their last period.  The
first gather, after ``warmup`` iterations, only sets the period: about
``interval`` seconds of steps, from the slowest rank's step time (start-up
is noisy, and a short run keeps equal shares).  From each
rank's seconds per record every rank derives the same new shares: counts
proportional to speed, in whole records (largest remainders), none below
``floor`` (b/10, at least 1).  They take effect only where the predicted
step (the slowest rank's share times its seconds per record) is at least
``gain`` (2%) shorter than the present one's: noise does not move them.
Proportional shares converge to equal compute times, the synchronous
step's optimum, whatever each rank's fixed cost an iteration.

A fixed ``B0:B1:...`` takes those counts for the whole run (a cluster whose
speeds are known, and the tests).  The shares, the period and the position
in it are in the snapshot (:meth:`state`), so a resumed run reads the same
records; later decisions depend on the measured times, as they would.
"""
import math
import statistics
import time

from ..common import AgreedError, CaffeError, log

BALANCE_MODES = ("off", "auto")


def parse_balance(text):
    """('off' | 'auto', None) or ('fixed', counts) of a --balance value."""
    text = str(text).strip()
    if text in BALANCE_MODES:
        return text, None
    try:
        counts = tuple(int(n) for n in text.split(":"))
    except ValueError:
        counts = ()
    if len(counts) < 2 or min(counts) < 1:
        raise CaffeError("--balance must be off, auto or per-rank record counts B0:B1:... (positive), got '%s'"
                         % text)
    return "fixed", counts


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
    sync, which calls :meth:`attach`, :meth:`before_iteration` and
    :meth:`after_compute` and keeps :meth:`state` in its own).  ``clock``
    gives seconds (a test's may be simulated)."""

    #: the share of the step a change must save
    gain = 0.02
    #: iterations measured before the first gather, which sets the period
    warmup = 5

    def __init__(self, mode="auto", interval=2.0, clock=time.perf_counter):
        self.mode, self.fixed = parse_balance(mode)
        self.interval = float(interval)
        self.clock = clock
        self.world = None
        self.net = None
        self.shares = None
        self.batch = None
        self._why = None
        self._count = 0              # iterations begun since the last decision
        self._period = self.warmup
        self._calibrated = False     # the period is set from measured steps
        self._window = []            # compute seconds of the iterations since the last decision
        self._start = None

    @property
    def active(self):
        return self.net is not None

    def attach(self, world, net, why_not=None):
        """Meet the net (on every rank; logs on rank 0 why shares stay equal
        where they must).  ``why_not``: the sync's own reason, if any."""
        self.world, self.net = world, None
        if self.mode == "off" or world.size < 2:
            return
        batch, why = net.shareable_batch()
        why = why_not or why
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
        if world.rank == 0:
            log.info("Batch shares: %s (--balance=%s)", self._describe(), self.mode)

    def _describe(self):
        shares = self.shares or (self.batch,) * self.world.size
        return "%s of %d" % (" ".join(map(str, shares)), sum(shares))

    def before_iteration(self):
        """At the start of an iteration: decide (collective, every period;
        auto only) and apply this iteration's shares."""
        if self.net is None:
            return
        if self.fixed is None and self._count >= self._period:
            self._decide()
        if self.net.batch_shares != self.shares:
            self.net.set_batch_shares(self.shares)
        self._count += 1
        self._start = self.clock()

    def after_compute(self):
        """The iteration's forward and backward passes are done."""
        if self.net is None or self._start is None:
            return
        self._window.append(self.clock() - self._start)
        self._start = None

    def _decide(self):
        mine = statistics.median(self._window) if self._window else 0.0
        seconds = self.world.allgather(mine, "the ranks' step times for the batch shares")
        self._window, self._count = [], 0
        current = self.shares or (self.batch,) * self.world.size
        if min(seconds) <= 0.0:
            return
        self._period = max(self.warmup, min(1000, int(round(self.interval / max(seconds)))))
        calibrated, self._calibrated = self._calibrated, True
        if not calibrated:
            return
        per_record = [s / n for s, n in zip(seconds, current)]
        total = sum(current)
        proposed = proportional_shares(total, per_record, floor=max(1, self.batch // 10))
        step_now = max(n * t for n, t in zip(current, per_record))
        step_new = max(n * t for n, t in zip(proposed, per_record))
        if proposed == current or step_new > step_now * (1.0 - self.gain):
            return
        self.shares = None if len(set(proposed)) == 1 else proposed
        if self.world.rank == 0:
            log.info("Batch shares: %s (step ms by rank: %s)", self._describe(),
                     " ".join("%.1f" % (1e3 * s) for s in seconds))

    def state(self):
        """What a resumed run needs to read the same records (JSON)."""
        if self.net is None:
            return None
        return {"shares": None if self.shares is None else list(self.shares), "count": self._count,
                "period": self._period, "calibrated": self._calibrated}

    def load_state(self, state):
        if self.net is None or not state:
            return
        shares = state.get("shares")
        self.shares = None if shares is None else tuple(int(n) for n in shares)
        self._count, self._period = int(state["count"]), int(state["period"])
        self._calibrated = bool(state["calibrated"])
        self._window = []
