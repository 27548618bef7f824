"""parse_log: a Caffe (or caffempi) training log -> two CSV files,
``<log>.train`` and ``<log>.test`` in OUTPUT_DIR, with the rows and columns
of BVLC's tools/extra/parse_log.py: NumIters, Seconds, LearningRate, then one
column per net output (e.g. loss; accuracy, loss).  A caffempi log whose
batch shares were shown (``--balance``) also gives ``<log>.shares``:
NumIters, Seconds, then each rank's count (rank0, rank1, ...), a row at
start-up and at each change.

    python tools/parse_log.py [--verbose] [--delimiter ,] LOGFILE OUTPUT_DIR
"""
import csv
import datetime
import os
import re
from collections import OrderedDict

from ..common import CaffeError
from ..flags import FlagSet
from ._util import info, run_tool

RE_ITERATION = re.compile(r"Iteration (\d+)")
RE_TRAIN_OUTPUT = re.compile(r"Train net output #(\d+): (\S+) = ([\.\deE+-]+)")
RE_TEST_OUTPUT = re.compile(r"Test net output #(\d+): (\S+) = ([\.\deE+-]+)")
RE_LEARNING_RATE = re.compile(r"lr = ([-+]?[0-9]*\.?[0-9]+([eE]?[-+]?[0-9]+)?)")
RE_SHARES = re.compile(r"Batch shares: ([\d ]+) of \d+")
RE_GLOG = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d+)")


def extract_datetime(line, year):
    m = RE_GLOG.match(line.strip())
    if not m:
        return None
    mo, d, h, mi, s, us = (int(g) for g in m.groups())
    return datetime.datetime(year, mo, d, h, mi, s, int(str(m.group(6))[:6].ljust(6, "0")))


def parse_log(path):
    """(train rows, test rows): lists of OrderedDicts as BVLC's parse_log."""
    return parse_all(path)[:2]


def parse_shares(path):
    """The batch-share rows of a log (OrderedDicts: NumIters, Seconds,
    rank0, rank1, ...), maybe none."""
    return parse_all(path)[2]


def parse_all(path):
    """(train rows, test rows, batch-share rows) of a log."""
    try:
        year = datetime.datetime.fromtimestamp(os.path.getmtime(path)).year
        with open(path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise CaffeError("cannot read log %s: %s" % (path, e.strerror or e)) from None
    start = None
    for line in lines:            # extract_seconds.get_start_time: the 'Solving' line
        if "Solving" in line:
            start = extract_datetime(line, year)
            if start:
                break
    if start is None:             # no 'Solving' line: the first glog line
        for line in lines:
            start = extract_datetime(line, year)
            if start:
                break
    iteration = -1
    lr = float("nan")
    train, test, shares = [], [], []
    train_row = test_row = None
    last = start
    for line in lines:
        m = RE_ITERATION.search(line)
        if m:
            iteration = float(m.group(1))
        m = RE_SHARES.search(line)
        if m:                      # shown at start-up (before iteration 0) and at each change
            row = OrderedDict([("NumIters", max(iteration, 0.0)), ("Seconds", _seconds(line, year, start))])
            row.update(("rank%d" % r, float(n)) for r, n in enumerate(m.group(1).split()))
            shares.append(row)
        if iteration == -1:
            continue
        t = extract_datetime(line, year)
        if t is not None:
            if last is not None and t < last - datetime.timedelta(days=180):
                t = t.replace(year=t.year + 1)       # the log crossed new year
            last = t
        seconds = (last - start).total_seconds() if (last and start) else 0.0
        m = RE_LEARNING_RATE.search(line)
        if m:
            lr = float(m.group(1))
        train, train_row = _net_output(RE_TRAIN_OUTPUT, train_row, train, line, iteration, seconds, lr)
        test, test_row = _net_output(RE_TEST_OUTPUT, test_row, test, line, iteration, seconds, lr)
    for rows in (train, test):     # fix_initial_nan_learning_rate
        if len(rows) > 1:
            rows[0]["LearningRate"] = rows[1]["LearningRate"]
    return train, test, shares


def _seconds(line, year, start):
    t = extract_datetime(line, year)
    return (t - start).total_seconds() if (t and start) else 0.0


def _net_output(regex, row, rows, line, iteration, seconds, lr):
    m = regex.search(line)
    if m:
        if not row or row["NumIters"] != iteration:
            if row:
                rows.append(row)
            row = OrderedDict([("NumIters", iteration), ("Seconds", seconds), ("LearningRate", lr)])
        row[m.group(2)] = float(m.group(3))
    if row and len(rows) >= 1 and len(row) == len(rows[0]):
        rows.append(row)
        row = None
    return rows, row


def write_csv(path, rows, delimiter=",", verbose=False):
    """csv.excel dialect (as BVLC's script), header from the first row."""
    with open(path, "w", newline="") as f:
        if rows:
            w = csv.DictWriter(f, fieldnames=list(rows[0].keys()), delimiter=delimiter)
            w.writeheader()
            w.writerows(rows)
    if verbose:
        info("Wrote %s", path)


def save_csv_files(log_path, output_dir, train, test, delimiter=",", verbose=False, shares=()):
    """Writes <log>.train and <log>.test, and <log>.shares where there are
    share rows; returns the paths written."""
    base = os.path.basename(log_path)
    os.makedirs(output_dir, exist_ok=True)
    out = (os.path.join(output_dir, base + ".train"), os.path.join(output_dir, base + ".test"))
    write_csv(out[0], train, delimiter, verbose)
    write_csv(out[1], test, delimiter, verbose)
    if shares:
        out += (os.path.join(output_dir, base + ".shares"),)
        write_csv(out[2], shares, delimiter, verbose)
    return out


def read_csv(path):
    """A .train/.test file -> list of dicts of floats."""
    with open(path, newline="") as f:
        return [{k: float(v) for k, v in r.items()} for r in csv.DictReader(f)]


FLAGS = FlagSet("parse_log", "Parse a Caffe training log into two CSV files containing training and "
                "testing information")
FLAGS.argument("logfile_path", "Path to log file")
FLAGS.argument("output_dir", "Directory in which to place output CSV files")
FLAGS.define("verbose", False, "Print some extra info (e.g., output filenames)")
FLAGS.define("delimiter", ",", "Column delimiter in output files")


def _main(flags, logfile_path, output_dir):
    train, test, shares = parse_all(logfile_path)
    save_csv_files(logfile_path, output_dir, train, test, flags.delimiter, flags.verbose, shares)


def main(argv=None):
    return run_tool(FLAGS, _main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
