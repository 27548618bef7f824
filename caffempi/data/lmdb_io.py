"""LMDB access as Caffe's db_lmdb does it: a database is a directory holding
data.mdb/lock.mdb; keys are bytes in sorted order; values are serialized Datums.

``LMDBWriter`` commits in chunks (Caffe's tools commit every 1000 records) and
grows the map size as needed (doubling on MDB_MAP_FULL)."""
import os
import threading

from ..common import CaffeError

BACKENDS = {0: "leveldb", 1: "lmdb", "leveldb": "leveldb", "lmdb": "lmdb",
            "LEVELDB": "leveldb", "LMDB": "lmdb"}


def check_backend(backend, where=""):
    name = BACKENDS.get(backend)
    if name is None:
        raise CaffeError("%sunknown database backend %r (lmdb or leveldb)" % (where, backend))
    if name == "leveldb":
        try:
            import plyvel  # noqa: F401
        except ImportError:
            raise CaffeError("%sthe LEVELDB backend needs the 'plyvel' package, which is not "
                             "installed; convert the database to LMDB (backend: LMDB)" % where) from None
        raise CaffeError("%sthe LEVELDB backend is not supported; use backend: LMDB" % where)
    return name


def looks_like_lmdb(path):
    """A directory with data.mdb, or a missing path (reported later as missing)."""
    path = os.fspath(path)
    return not os.path.exists(path) or os.path.exists(os.path.join(path, "data.mdb")) or \
        (os.path.isfile(path) and not os.path.isdir(path) and path.endswith(".mdb"))


def _lmdb():
    try:
        import lmdb
        return lmdb
    except ImportError:
        raise CaffeError("reading LMDB needs the 'lmdb' package (pip install lmdb)") from None


_OPEN = {}          # real path -> [env, users]: py-lmdb opens an environment once per process
_OPEN_LOCK = threading.Lock()


def open_read(path):
    """Open an existing LMDB read-only (shared within the process; give it
    back with :func:`release`).  CaffeError naming the path when it is
    missing, not an LMDB, or empty.  Returns (env, number of entries)."""
    lmdb = _lmdb()
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CaffeError("%s: no such LMDB database" % path)
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "data.mdb")):
        raise CaffeError("%s: not an LMDB database (no data.mdb in the directory)" % path)
    real = os.path.realpath(path)
    with _OPEN_LOCK:
        if real in _OPEN:
            env = _OPEN[real][0]
            _OPEN[real][1] += 1
        else:
            try:
                env = lmdb.open(path, readonly=True, lock=False, readahead=False,
                                subdir=os.path.isdir(path), max_readers=256)
            except lmdb.Error as e:
                raise CaffeError("%s: cannot open LMDB database: %s" % (path, e)) from None
            _OPEN[real] = [env, 1]
    n = env.stat()["entries"]
    if n == 0:
        release(env)
        raise CaffeError("%s: the database is empty" % path)
    return env, n


def release(env):
    """Give back an environment from :func:`open_read` (closed when unused)."""
    with _OPEN_LOCK:
        for real, entry in list(_OPEN.items()):
            if entry[0] is env:
                entry[1] -= 1
                if entry[1] <= 0:
                    del _OPEN[real]
                    env.close()
                return


def read_all(path):
    """[(key bytes, value bytes)] in key order (for tests and small tools)."""
    env, _ = open_read(path)
    try:
        with env.begin() as txn:
            return [(bytes(k), bytes(v)) for k, v in txn.cursor()]
    finally:
        release(env)


class LMDBWriter:
    """Write (key, value) pairs into a new LMDB (Caffe's db::LMDB in NEW mode:
    the database must not exist yet).  Use as a context manager."""

    def __init__(self, path, map_size=1 << 26, commit_every=1000, overwrite=False):
        lmdb = _lmdb()
        self.path = os.fspath(path)
        if os.path.exists(self.path) and not overwrite:
            raise CaffeError("%s: database already exists (remove it first)" % self.path)
        if overwrite and os.path.isdir(self.path):
            for f in ("data.mdb", "lock.mdb"):
                p = os.path.join(self.path, f)
                if os.path.exists(p):
                    os.unlink(p)
        try:
            os.makedirs(self.path, exist_ok=True)
            self.env = lmdb.open(self.path, map_size=map_size, subdir=True, meminit=False)
        except (OSError, lmdb.Error) as e:
            raise CaffeError("%s: cannot create LMDB database: %s" % (self.path, e)) from None
        self.commit_every = commit_every
        self.pending = []
        self.count = 0

    def put(self, key, value):
        if isinstance(key, str):
            key = key.encode()
        self.pending.append((key, value))
        self.count += 1
        if len(self.pending) >= self.commit_every:
            self.commit()

    def commit(self):
        lmdb = _lmdb()
        if not self.pending:
            return
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    for k, v in self.pending:
                        txn.put(k, v)
                break
            except lmdb.MapFullError:
                self.env.set_mapsize(self.env.info()["map_size"] * 2)
        self.pending = []

    def close(self):
        if self.env is not None:
            self.commit()
            self.env.sync()
            self.env.close()
            self.env = None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.env.close()
            self.env = None
