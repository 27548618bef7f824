"""Atomic file writes: a reader of ``path`` sees the old file or the new one
whole, never a part, and a crash leaves no partial file under that name.

The new contents go to a hidden temporary file beside ``path``
(``.NAME.PID.RANDOM.tmp``: unique per process and call, so concurrent
writers never share one), which is fsync'ed and renamed over ``path``; the
directory is then fsync'ed so that the rename itself is durable.
"""
import contextlib
import os


@contextlib.contextmanager
def atomic_path(path):
    """Yield the name of a new, empty temporary file in ``path``'s directory
    for the block to write (by name, as h5py needs).  On normal exit it is
    fsync'ed and replaces ``path``; on any exception it is removed and
    ``path`` is left as it was.  OSError (an unwritable directory, ...)
    propagates; the caller names the file in its own error."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    while True:
        tmp = os.path.join(directory, ".%s.%d.%s.tmp" % (os.path.basename(path), os.getpid(),
                                                         os.urandom(4).hex()))
        try:
            # O_EXCL: the name is ours alone; mode 0o666 less the umask, as
            # any new file (the result keeps it)
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            break
        except FileExistsError:
            continue
    try:
        yield tmp
        _fsync(tmp, os.O_RDONLY)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):      # a file system that cannot sync a directory
        _fsync(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))


def write_bytes_atomic(path, payload):
    """``path``'s contents become ``payload`` (bytes), atomically."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(payload)


def _fsync(name, flags):
    fd = os.open(name, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
