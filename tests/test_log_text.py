"""Logs are text: strings from MPI, the OS or a user file reach a log line
without NUL or control characters (common.printable), and a 2-rank
training log reads as BVLC's tools/extra/parse_log.sh and parse_log.py
read a Caffe log (their grep, sed and awk layout and their regular
expressions, mirrored here: our code, not theirs)."""
import datetime
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from caffempi import common
from caffempi.common import CaffeError, printable
from test_log_format import NET, extract_datetime_from_line, parse_log  # BVLC parse_log.py's layout

REPO = Path(__file__).resolve().parents[1]
CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f\ud800-\udfff]")   # what no log line may hold
GLOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d{6} +\d+ [\w.]+:\d+\] ")

# Open MPI's MPI_Get_library_version, as mpi4py returns it: the length
# counts the C string's terminator
OPEN_MPI = ("Open MPI v4.1.2, package: Debian OpenMPI, ident: 4.1.2, repo rev: v4.1.2, "
            "Nov 24, 2021\0")


# ------------------------------------------------------------------ printable
@pytest.mark.parametrize("text, expected", [
    (OPEN_MPI, OPEN_MPI[:-1]),                          # the terminator goes
    ("node7\0\0", "node7"),
    ("a\0b", "a\\x00b"),                                # a NUL inside is shown
    ("x\x1b[31m y\r", "x\\x1b[31m y\\r"),
    ("line\nforged", "line\\nforged"),                  # one value, one line
    ("tab\tkept, caf\u00e9 \u2713", "tab\tkept, caf\u00e9 \u2713"),
    ("del\x7f c1\x85", "del\\x7f c1\\x85"),
    ("bad\udcffname", "bad\\udcffname"),                # os.fsdecode's undecodable byte
    (b"raw\xff\0", "raw\\xff"),
    (12, "12"),
])
def test_printable(text, expected):
    assert printable(text) == expected
    assert not CONTROL.search(printable(text))


def test_printable_keeps_newlines_when_asked():
    assert printable("a\nb\0\r\n", newlines=True) == "a\nb\\x00\\r\n"


@pytest.fixture
def log_text():
    """What caffempi logs in the block, as glog lines."""
    buf = io.StringIO()
    common.init_logging(stream=buf)
    try:
        yield buf
    finally:
        common.init_logging()


def test_formatter_makes_every_record_text(log_text):
    common.log.info("from %s: %s", "a file", "x\0y\x1b z")
    common.log.info("two\nlines\0")
    text = log_text.getvalue()
    assert GLOG.match(text) and text.splitlines()[0].split("] ", 1)[1] == "from a file: x\\x00y\\x1b z"
    assert text.endswith("] two\nlines\n")


# ------------------------------------------- MPI's strings through start_rank
class _Comm:
    def Get_rank(self):
        return 0

    def Get_size(self):
        return 2


class _OpenMPI:
    """mpi4py.MPI as Open MPI's answers it: library version and processor
    name end in the C string's NUL."""
    COMM_WORLD = _Comm()

    @staticmethod
    def Query_thread():
        return 0

    @staticmethod
    def Get_library_version():
        return OPEN_MPI

    @staticmethod
    def Get_processor_name():
        return "node1\0"


def test_mpi_library_string_with_nul_logs_as_text(monkeypatch, capsys):
    """The MPI line of a job's start (rank.start_rank) from an MPIWorld whose
    MPI answers with NUL-terminated strings: the line has no NUL."""
    from caffempi.parallel import comm, rank
    from caffempi.parallel.config import ParallelConfig
    world = comm.MPIWorld(_OpenMPI)
    monkeypatch.setattr(rank, "get_world", lambda *a, **k: world)
    monkeypatch.setattr(rank, "share_cores", lambda w: 1)       # no collective, no thread count change
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)      # install_abort_handlers' hooks: undone after
    import threading
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)
    try:
        rank.start_rank(ParallelConfig())
    finally:
        common.init_logging()
    err = capsys.readouterr().err
    line = [l for l in err.splitlines() if "] MPI: 2 ranks" in l]
    assert line == [line[0]] and GLOG.match(line[0])
    assert line[0].endswith("] MPI: 2 ranks (%s), rank 0 on node1" % OPEN_MPI[:-1])
    assert "\0" not in err and not CONTROL.search(err.replace("\n", ""))


def test_rank_error_line_is_text(capsys):
    from caffempi.parallel import rank
    from caffempi.parallel.comm import SingleWorld
    world = SingleWorld()
    world.size, world.rank = 2, 1
    exc = CaffeError("cannot read /data/x\0\x1b.lmdb: MPI says %s" % OPEN_MPI)
    rank._report(world, CaffeError, exc, None)
    err = capsys.readouterr().err
    assert err == "[rank 1] caffempi: error: cannot read /data/x\\x00\\x1b.lmdb: MPI says %s\n" % OPEN_MPI[:-1]


def test_cli_error_and_log_lines_from_a_user_file_are_text(tmp_path):
    """A solver file naming a net file with control characters in its name:
    the log line and the error line show them escaped."""
    solver = tmp_path / "solver.prototxt"
    solver.write_bytes(b'net: "%s/n\x1b[31m\x00.prototxt"\nbase_lr: 0.1\nlr_policy: "fixed"\nmax_iter: 1\n'
                       % str(tmp_path).encode())
    env = dict(os.environ, PYTHONPATH=str(REPO), CAFFEMPI_MPI="0")
    p = subprocess.run([sys.executable, "-m", "caffempi", "train", "--solver=%s" % solver],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 1
    assert "] Creating training net from net file: %s/n\\x1b[31m\\x00.prototxt\n" % tmp_path in p.stderr
    assert p.stderr.endswith("caffempi: error: net file %s/n\\x1b[31m\\x00.prototxt does not exist\n" % tmp_path)
    assert not CONTROL.search(p.stderr.replace("\n", ""))


def test_grep_reads_a_log_with_open_mpis_line_as_text(tmp_path, log_text):
    """The failure BVLC's parse_log.sh showed: a NUL in the log makes grep
    answer "binary file matches" instead of the lines it greps for."""
    grep = shutil.which("grep")
    if grep is None:
        pytest.skip("no grep")
    common.log.info("MPI: 2 ranks (%s), rank 0 on node1", OPEN_MPI)
    common.log.info("Iteration 0 (0 iter/s, 0.1s/1 iters), loss = 2.3")
    path = tmp_path / "caffe.log"
    path.write_text(log_text.getvalue())
    out = subprocess.run([grep, ", loss = ", str(path)], capture_output=True, text=True,
                         env=dict(os.environ, LC_ALL="C")).stdout
    assert out.endswith("] Iteration 0 (0 iter/s, 0.1s/1 iters), loss = 2.3\n")


# ------------------------------------------------- BVLC's parsers, mirrored
# tools/extra/parse_log.py (BVLC master): its regular expressions, row
# building, and extract_seconds' time parsing; lines that are not glog's
# (a rank's "[rank 1] " prefix) are skipped, as its ValueError handler does.
def parse_log_sh(text, year):
    """tools/extra/parse_log.sh's tables (columns as its paste joins them):
    test (#Iters Seconds TestAccuracy TestLoss), train (#Iters Seconds
    TrainingLoss LearningRate), each column a list of strings."""
    lines = text.splitlines()
    iteration_of = lambda l: re.sub(r'.*Iteration ([0-9]*).*', r'\1', l)  # noqa: E731
    seconds = lambda ls, start: ['%f' % (extract_datetime_from_line(l, year) - start).total_seconds()  # noqa: E731
                                 for l in ls if 'Iteration' in l]
    # sed -n '/Iteration .* Testing net/,/Iteration *. loss/p', then its deletions
    aux, inside = [], False
    for l in lines:
        if not inside and re.search(r'Iteration .* Testing net', l):
            inside = True
            aux.append(l)
        elif inside:
            aux.append(l)
            if re.search(r'Iteration *. loss', l):
                inside = False
    aux = [l for l in aux if not re.search(r'Waiting for data|prefetch queue empty|Iteration .* loss|'
                                           r'Iteration .* lr|Train net', l)]
    solving = [l for l in lines if '] Solving ' in l]
    start = extract_datetime_from_line(solving[0], year)
    test = {"iters": [iteration_of(l) for l in aux if 'Iteration ' in l],
            "seconds": seconds(solving + [l for l in lines if 'Testing net' in l], start),
            "accuracy": [l.split()[10] for l in aux if 'Test net output #0' in l],      # awk '{print $11}'
            "loss": [l.split()[10] for l in aux if 'Test net output #1' in l]}
    loss_lines = [l for l in lines if ', loss = ' in l]
    train = {"iters": [iteration_of(l) for l in solving + loss_lines if 'Iteration ' in l],
             "seconds": seconds(solving + loss_lines, start),
             "loss": [l.split('=')[1] for l in loss_lines],                              # awk -F = '{print $2}'
             "lr": [l.split()[8] for l in lines if ', lr = ' in l]}                      # awk '{print $9}'
    return train, test


SOLVER = ('net: "%s" base_lr: 0.1 lr_policy: "step" gamma: 0.5 stepsize: 2 max_iter: 4 display: 1 '
          'test_iter: 2 test_interval: 2 momentum: 0.9 random_seed: 1 snapshot_after_train: false\n')


def _have_mpi():
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    from caffempi.parallel.launch import mpiexec_path
    return mpiexec_path() is not None


@pytest.fixture(scope="module")
def two_rank_log(tmp_path_factory):
    """stderr of `mpiexec -n 2 python -m caffempi train` on a tiny net, as
    a user's `2>&1 | tee caffe.log` keeps it."""
    if not _have_mpi():
        pytest.skip("mpi4py or mpiexec not available")
    from caffempi.parallel.launch import mpiexec_path
    d = tmp_path_factory.mktemp("two_rank_log")
    (d / "net.prototxt").write_text(NET)
    (d / "solver.prototxt").write_text(SOLVER % (d / "net.prototxt"))
    env = dict(os.environ, PYTHONPATH=str(REPO), OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    env.pop("CAFFEMPI_MPI", None)
    cmd = [mpiexec_path(), "-n", "2", sys.executable, "-m", "caffempi", "train",
           "--solver=%s" % (d / "solver.prototxt")]
    p = subprocess.run(cmd, cwd=d, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    (d / "caffe.log").write_text(p.stdout + p.stderr)
    return d / "caffe.log"


def test_two_rank_log_is_text(two_rank_log):
    text = two_rank_log.read_text()
    assert "] MPI: 2 ranks (" in text and text.rstrip().endswith("Optimization Done.")
    assert not CONTROL.search(text.replace("\n", ""))


def test_parse_log_py_reads_a_two_rank_log(two_rank_log):
    train, test = parse_log(two_rank_log.read_text())
    assert [r["NumIters"] for r in train] == [0, 1, 2, 3]
    assert all(list(r) == ["NumIters", "Seconds", "LearningRate", "loss"] for r in train)
    assert [r["LearningRate"] for r in train] == [0.1, 0.1, 0.1, 0.05]
    assert [r["NumIters"] for r in test] == [0, 2, 4]
    assert all(list(r) == ["NumIters", "Seconds", "LearningRate", "accuracy", "loss"] for r in test)
    assert all(0 <= r["accuracy"] <= 1 and r["loss"] > 0 and r["Seconds"] >= 0 for r in test)


def test_parse_log_sh_reads_a_two_rank_log(two_rank_log):
    train, test = parse_log_sh(two_rank_log.read_text(), datetime.date.today().year)
    assert test["iters"] == ["0", "2", "4"] and len(test["seconds"]) == 3
    assert all(0 <= float(v) <= 1 for v in test["accuracy"]) and len(test["accuracy"]) == 3
    assert all(float(v) > 0 for v in test["loss"]) and len(test["loss"]) == 3
    assert train["iters"] == ["0", "1", "2", "3", "4"] and len(train["seconds"]) == 5
    assert all(float(v) > 0 for v in train["loss"]) and len(train["loss"]) == 5
    assert train["lr"] == ["0.1", "0.1", "0.05", "0.05"]
