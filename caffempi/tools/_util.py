"""Small helpers shared by the tools."""
import sys

from ..common import CaffeError, configure_logging, log


def info(msg, *args):
    """An INFO line of the tool's log, in glog's format as Caffe's tools
    write theirs (its file and line are the caller's)."""
    log.info(msg, *args, stacklevel=2)


def progress(iterable, total=None, desc=None):
    """tqdm progress bar on a terminal; plain iteration otherwise."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return iterable
    return tqdm(iterable, total=total, desc=desc, disable=None, unit="rec")


def run_tool(flag_set, body, argv=None):
    """A tool's main: parse ``argv`` (default: the command line) with
    ``flag_set`` (caffempi.flags), answer --help and --version, apply glog's
    flags, then ``body(flags, *arguments)``.  Bad input (CaffeError,
    ProtoError) is one line on stderr, ``<tool>: error: <message>``, and
    exit status 1.  Returns the exit status."""
    from ..io.proto_io import ProtoError
    try:
        flags, arguments = flag_set.parse(sys.argv[1:] if argv is None else argv)
        answer = flag_set.answer(flags)
        if answer is not None:
            print(answer)
            return 0
        configure_logging(flag_set.program, flags)
        return body(flags, *arguments) or 0
    except (CaffeError, ProtoError) as e:
        print("%s: error: %s" % (flag_set.program, " ".join(str(e).split())), file=sys.stderr)
        return 1

