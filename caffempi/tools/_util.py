"""Small helpers shared by the tools."""
import sys

from ..common import CaffeError


def info(msg, *args):
    print(msg % args if args else msg, file=sys.stderr, flush=True)


def progress(iterable, total=None, desc=None):
    """tqdm progress bar on a terminal; plain iteration otherwise."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return iterable
    return tqdm(iterable, total=total, desc=desc, disable=None, unit="rec")


def run_main(fn, argv=None):
    """Run a tool's body; a CaffeError becomes one line on stderr and exit status 1."""
    from ..io.proto_io import ProtoError
    try:
        return fn(argv) or 0
    except (CaffeError, ProtoError) as e:
        print("error: %s" % e, file=sys.stderr)
        return 1
