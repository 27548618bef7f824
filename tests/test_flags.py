"""caffempi.flags (gflags' command-line forms, flagfiles, --help/--version)
and glog's flags (common.configure_logging: --log_dir files, levels)."""
import getpass
import io
import logging
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from caffempi import __version__, common
from caffempi.common import CaffeError, log
from caffempi.flags import FlagSet

REPO = Path(__file__).resolve().parents[1]
GLOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d{6} +\d+ [\w.]+:\d+\] ")


def flag_set():
    fs = FlagSet("prog", "does things")
    fs.argument("SRC", "the input")
    fs.argument("DST", "the output", default="out")
    fs.define("name", "x", "a string")
    fs.define("count", 1, "an int")
    fs.define("rate", 0.5, "a float")
    fs.define("shuffle", False, "a boolean")
    fs.define("item", [], "a list")
    return fs


# ------------------------------------------------------------------ forms
@pytest.mark.parametrize("argv", [
    ["-name=a", "--count=3", "in"], ["--name", "a", "-count", "3", "in"],
    ["in", "-name", "a", "--count=3"], ["--count", "3", "in", "--name=a"],
])
def test_value_forms_and_arguments_anywhere(argv):
    flags, args = flag_set().parse(argv)
    assert (flags.name, flags.count, flags.rate, flags.shuffle) == ("a", 3, 0.5, False)
    assert args == ["in", "out"]


@pytest.mark.parametrize("argv,value", [
    (["--shuffle"], True), (["-shuffle"], True), (["--shuffle=true"], True), (["--shuffle=1"], True),
    (["--shuffle=yes"], True), (["-shuffle=T"], True), (["--shuffle=false"], False), (["--shuffle=0"], False),
    (["--shuffle=no"], False), (["--shuffle", "--noshuffle"], False), (["-noshuffle"], False), ([], False),
])
def test_boolean_forms(argv, value):
    flags, args = flag_set().parse(argv + ["in"])
    assert flags.shuffle is value and args == ["in", "out"]


def test_a_boolean_does_not_take_the_next_argument():
    flags, args = flag_set().parse(["--shuffle", "in", "dst"])
    assert flags.shuffle is True and args == ["in", "dst"]


def test_double_dash_ends_the_flags_and_dash_is_an_argument():
    flags, args = flag_set().parse(["--count=2", "--", "--name=z", "-"])
    assert flags.count == 2 and flags.name == "x" and args == ["--name=z", "-"]
    assert flag_set().parse(["-", "--count=4"])[1] == ["-", "out"]


def test_last_value_wins_but_a_list_collects():
    flags, _ = flag_set().parse(["--count=2", "-count=5", "--item=a,b", "-item", "c", "in"])
    assert flags.count == 5 and flags.item == ["a", "b", "c"]
    assert flag_set().parse(["in"])[0].item == []


@pytest.mark.parametrize("argv,message", [
    (["--bogus=1", "in"], r"^unknown flag --bogus \(see 'prog --help'\)$"),
    (["-bogus", "in"], r"^unknown flag -bogus "),
    (["in", "--count"], r"^flag --count needs a value$"),
    (["--count=many", "in"], r"^invalid value for --count: 'many' \(int expected\)$"),
    (["--rate=fast", "in"], r"invalid value for --rate: 'fast' \(float expected\)"),
    (["--shuffle=maybe", "in"], r"invalid value for --shuffle: 'maybe' \(true or false\)"),
    (["--nocount", "in"], r"--nocount: --count is not a boolean flag"),
    (["--noshuffle=1", "in"], r"--noshuffle takes no value"),
    ([], r"^missing argument SRC \(usage: prog \[FLAGS\] SRC \[DST\]\)$"),
    (["a", "b", "c"], r"^unexpected argument 'c'"),
])
def test_bad_command_lines_are_one_clear_error(argv, message):
    with pytest.raises(CaffeError) as e:
        flag_set().parse(argv)
    assert re.search(message, str(e.value)), str(e.value)
    assert "\n" not in str(e.value)


def test_arguments_kinds_defaults_and_repeats():
    fs = FlagSet("plot", "plots")
    fs.argument("TYPE", "chart", kind=int)
    fs.argument("FILE", "inputs", repeated=True)
    assert fs.parse(["3", "a", "b"])[1] == [3, "a", "b"]
    with pytest.raises(CaffeError, match="missing argument FILE"):
        fs.parse(["3"])
    with pytest.raises(CaffeError, match="invalid value for TYPE: 'x'"):
        fs.parse(["x", "a"])
    assert fs.usage_line() == "plot [FLAGS] TYPE FILE..."


def test_without_removes_every_form_of_a_flag():
    fs = flag_set()
    argv = ["in", "--count=2", "-name", "n", "-count", "3", "--shuffle", "--count", "4", "--", "--count=9"]
    assert fs.without(argv, "count") == ["in", "-name", "n", "--shuffle", "--", "--count=9"]
    assert fs.parse(fs.without(argv, "count"))[0].count == 1


# -------------------------------------------------------------- flagfiles
def test_flagfile_lines_comments_nesting_and_order(tmp_path):
    inner = tmp_path / "inner.flags"
    inner.write_text("# nested\n--rate=0.25\n-shuffle\n")
    outer = tmp_path / "outer.flags"
    outer.write_text("  # a comment\n\n--name=fromfile\n--count=7\n--flagfile=%s\n   --item=a\n" % inner)
    flags, args = flag_set().parse(["--count=1", "--flagfile=%s" % outer, "--name=later", "in"])
    # the file applies where it stands: before it --count=1 is replaced, after it --name wins
    assert (flags.name, flags.count, flags.rate, flags.shuffle, flags.item) == ("later", 7, 0.25, True, ["a"])
    assert args == ["in", "out"]
    two = flag_set().parse(["-flagfile", "%s,%s" % (inner, outer), "in"])[0]
    assert two.rate == 0.25 and two.name == "fromfile"


def test_flagfile_program_sections(tmp_path):
    f = tmp_path / "all.flags"
    f.write_text("--count=2\nother_tool\n--count=3\npr?g another\n--name=mine\n--rate=2\n"
                 "nomatch\n--shuffle\n")
    flags, _ = flag_set().parse(["--flagfile=%s" % f, "in"])
    assert (flags.count, flags.name, flags.rate, flags.shuffle) == (2, "mine", 2.0, False)


@pytest.mark.parametrize("text,message", [
    ("--count=2\n--bogus=1\n", r"all\.flags:2: unknown flag --bogus"),
    ("--count\n", r"all\.flags:1: flag --count needs a value"),
    ("--count=x\n", r"all\.flags:1: invalid value for --count"),
    ("-\n", r"all\.flags:1: '-' is not a flag"),
])
def test_flagfile_errors_name_the_line(tmp_path, text, message):
    f = tmp_path / "all.flags"
    f.write_text(text)
    with pytest.raises(CaffeError, match=message):
        flag_set().parse(["--flagfile=%s" % f, "in"])


def test_flagfile_missing_or_including_itself(tmp_path):
    with pytest.raises(CaffeError, match=r"--flagfile=.*nope\.flags: No such file"):
        flag_set().parse(["--flagfile=%s" % (tmp_path / "nope.flags"), "in"])
    loop = tmp_path / "loop.flags"
    loop.write_text("--flagfile=%s\n" % loop)
    with pytest.raises(CaffeError, match="includes itself"):
        flag_set().parse(["--flagfile=%s" % loop, "in"])


# ------------------------------------------------------- --help, --version
def test_help_is_gflags_style_and_skips_the_argument_checks():
    fs = flag_set()
    flags, args = fs.parse(["--help"])                 # SRC missing: not an error with --help
    text = fs.answer(flags)
    assert text.startswith("prog: does things\nUsage:\n    prog [FLAGS] SRC [DST]\n")
    assert "    SRC (the input)" in text
    assert '    -name (a string) type: string default: "x"' in text
    assert "    -count (an int) type: int32 default: 1" in text
    assert "    -rate (a float) type: double default: 0.5" in text
    assert "    -shuffle (a boolean) type: bool default: false" in text
    # the program's own flags first, then gflags' and glog's
    assert text.index("-shuffle") < text.index("-flagfile") < text.index("-log_dir")
    assert all(len(line) <= 80 for line in text.splitlines())
    assert fs.answer(fs.parse(["-helpfull"])[0]) == text
    assert fs.answer(fs.parse(["--version"])[0]) == "prog version %s" % __version__
    assert fs.answer(fs.parse(["in"])[0]) is None


def test_a_flag_is_defined_once():
    with pytest.raises(ValueError, match="defined twice"):
        flag_set().define("count", 2, "again")


def run(args, cwd=None):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable] + args, capture_output=True, text=True, timeout=60, cwd=cwd, env=env)


def test_programs_exit_1_on_an_unknown_flag_and_0_on_version():
    """gflags: 'ERROR: unknown command line flag' and exit(1); --version exits 0."""
    for args, prog in ((["-m", "caffempi", "train", "--bogus"], "caffempi"),
                       ([str(REPO / "tools" / "convert_imageset.py"), "-bogus", "a", "b", "c"], "convert_imageset")):
        r = run(args)
        bad = [a for a in args if "bogus" in a][0]
        assert r.returncode == 1 and r.stderr.strip() == "%s: error: unknown flag %s (see '%s --help')" % (
            prog, bad, prog), r.stderr
    r = run([str(REPO / "tools" / "compute_image_mean.py"), "--version"])
    assert r.returncode == 0 and r.stdout.strip() == "compute_image_mean version %s" % __version__


# -------------------------------------------------------------- glog flags
@pytest.fixture
def glog():
    """configure_logging(...) for a test, the defaults restored after it."""
    defaults = FlagSet("defaults", "").parse([])[0]

    def configure(argv, program="prog", rank=None):
        flags, _ = FlagSet(program, "").parse(argv)
        common.configure_logging(program, flags, rank)
    yield configure
    common.configure_logging("prog", defaults)


def emit_each_severity():
    log.debug("verbose line")
    log.info("info line")
    log.warning("warning line")
    log.error("error line")


def test_log_dir_writes_glogs_file_and_link(tmp_path, glog, capsys):
    glog(["--log_dir=%s" % tmp_path], program="mytool")
    emit_each_severity()
    files = [p for p in tmp_path.iterdir() if not p.is_symlink()]
    assert len(files) == 1
    m = re.fullmatch(r"mytool\.(.+)\.(.+)\.log\.INFO\.(\d{8}-\d{6})\.(\d+)", files[0].name)
    assert m and m.group(1) == socket.gethostname() and int(m.group(4)) == os.getpid()
    link = tmp_path / "mytool.INFO"
    assert link.is_symlink() and os.readlink(link) == files[0].name
    text = link.read_text().splitlines()
    assert text[0].startswith("Log file created at: ") and text[1] == "Running on machine: " + socket.gethostname()
    assert text[3] == "Log line format: [IWEF]mmdd hh:mm:ss.uuuuuu threadid file:line] msg"
    body = text[4:]
    assert [line.split("] ", 1)[1] for line in body] == ["info line", "warning line", "error line"]
    assert all(GLOG_LINE.match(line) for line in body) and [line[0] for line in body] == ["I", "W", "E"]
    # stderr has the same lines (--alsologtostderr is on by default)
    err = capsys.readouterr().err.splitlines()
    assert [line.split("] ", 1)[1] for line in err] == ["info line", "warning line", "error line"]


def test_log_dir_per_rank_names(tmp_path, glog):
    glog(["--log_dir=%s" % tmp_path], program="caffempi", rank=1)
    log.info("rank one")
    glog(["--log_dir=%s" % tmp_path], program="caffempi", rank=0)
    log.info("rank zero")
    files = {p.name for p in tmp_path.iterdir() if not p.is_symlink()}
    assert os.readlink(tmp_path / "caffempi.INFO") in files and os.readlink(tmp_path / "caffempi.rank1.INFO") in files
    prefixes = sorted(name.split(".log.INFO.")[0] for name in files)
    assert prefixes == sorted(["caffempi.%s.%s" % (socket.gethostname(), getpass.getuser()),
                               "caffempi.rank1.%s.%s" % (socket.gethostname(), getpass.getuser())])
    assert (tmp_path / "caffempi.rank1.INFO").read_text().endswith("] rank one\n")
    assert (tmp_path / "caffempi.INFO").read_text().endswith("] rank zero\n")


@pytest.mark.parametrize("argv,stderr_lines,file_lines", [
    ([], ["info", "warning", "error"], ["info", "warning", "error"]),
    (["--minloglevel=1"], ["warning", "error"], ["warning", "error"]),
    (["--minloglevel=2"], ["error"], ["error"]),
    (["--minloglevel=3"], [], []),
    (["--v=1"], ["verbose", "info", "warning", "error"], ["verbose", "info", "warning", "error"]),
    (["--v=1", "--minloglevel=1"], ["warning", "error"], ["warning", "error"]),
    (["--alsologtostderr=false"], ["error"], ["info", "warning", "error"]),
    (["--noalsologtostderr", "--stderrthreshold=1"], ["warning", "error"], ["info", "warning", "error"]),
    (["--logtostderr"], ["info", "warning", "error"], None),
    (["--logtostderr", "--noalsologtostderr"], ["info", "warning", "error"], None),
])
def test_levels_and_destinations(tmp_path, glog, capsys, argv, stderr_lines, file_lines):
    glog(argv + ["--log_dir=%s" % tmp_path])
    emit_each_severity()
    err = [line.split("] ", 1)[1] for line in capsys.readouterr().err.splitlines()]
    assert err == [w + " line" for w in stderr_lines]
    if file_lines is None:
        assert list(tmp_path.iterdir()) == []
    else:
        body = (tmp_path / "prog.INFO").read_text().splitlines()[4:]
        assert [line.split("] ", 1)[1] for line in body] == [w + " line" for w in file_lines]
        assert all(GLOG_LINE.match(line) for line in body)


@pytest.mark.parametrize("argv,message", [
    (["--minloglevel=4"], r"--minloglevel=4: expected 0 \(INFO\), 1 \(WARNING\), 2 \(ERROR\) or 3 \(FATAL\)"),
    (["--stderrthreshold=-1"], r"--stderrthreshold=-1"),
    (["--v=-2"], r"--v=-2: expected 0 or more"),
    (["--log_dir=/nonexistent/logs"], r"--log_dir=/nonexistent/logs: no such directory"),
])
def test_bad_glog_values(glog, argv, message):
    with pytest.raises(CaffeError, match=message):
        glog(argv)


def test_rank_stderr_level_keeps_the_file_complete(tmp_path, glog):
    """A rank other than 0 writes warnings only to stderr, all of its lines to its file."""
    glog(["--log_dir=%s" % tmp_path], rank=2)
    buf = io.StringIO()
    common.init_logging(logging.WARNING, prefix="[rank 2] ", stream=buf)
    log.info("mine")
    log.warning("careful")
    assert [line.split("] ", 1)[1] for line in buf.getvalue().splitlines()] == ["[rank 2] careful"]
    body = (tmp_path / "prog.rank2.INFO").read_text().splitlines()[4:]
    assert [line.split("] ", 1)[1] for line in body] == ["mine", "careful"]
