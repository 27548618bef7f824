"""Caffe's key-value databases of serialized Datums, LMDB and LevelDB, behind
one interface (Caffe's db::DB): records are (key bytes, value bytes) in key
order, read through a cursor and written into a new database in batches.

Reading: :func:`open_read` gives a :class:`Database` shared within the
process (py-lmdb opens an environment once per process and LevelDB locks its
directory; :func:`release` gives it back), with ``num`` records and
``cursor()``, a context manager for a :class:`Cursor` (``first``, ``next``,
``key``, ``value``).  Writing: :func:`open_writer` gives a :class:`Writer`
for a path that must not exist yet (Caffe's db::NEW mode), committing every
1000 records as Caffe's tools do.

Errors are one-line CaffeErrors naming the path.  LevelDB needs the
``plyvel`` package (``pip install plyvel``, also ``caffempi[leveldb]``).
"""
import contextlib
import os
import shutil
import tempfile
import threading

from ..common import CaffeError, log

# DataParameter.DB values and the tools' -backend strings -> backend name
BACKENDS = {0: "leveldb", 1: "lmdb", "leveldb": "leveldb", "lmdb": "lmdb",
            "LEVELDB": "leveldb", "LMDB": "lmdb"}


def backend_name(backend):
    """'lmdb' or 'leveldb' for a DataParameter.DB value or a -backend string."""
    name = BACKENDS.get(backend)
    if name is None:
        raise CaffeError("unknown database backend %r (lmdb or leveldb)" % (backend,))
    return name


def detect_backend(path):
    """The backend whose files the directory ``path`` holds (data.mdb: LMDB,
    CURRENT: LevelDB), else None."""
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, "data.mdb")) or (os.path.isfile(path) and path.endswith(".mdb")):
        return "lmdb"
    if os.path.isfile(os.path.join(path, "CURRENT")):
        return "leveldb"
    return None


# ------------------------------------------------------------------ reading
class Cursor:
    """Walks a database in key order (py-lmdb's cursor methods).  ``first()``,
    ``next()`` and ``set_key(key)`` return whether the cursor is on a record
    (``set_key``: on that exact key); ``key()`` and ``value()`` read it."""

    def first(self):
        raise NotImplementedError

    def next(self):
        raise NotImplementedError

    def set_key(self, key):
        raise NotImplementedError

    def key(self):
        raise NotImplementedError

    def value(self):
        raise NotImplementedError


class Database:
    """An open database, read-only.  Subclasses open it in ``__init__``
    (after checking that ``path`` holds one) and set ``num``."""
    label = None          # the backend's name in messages

    def __init__(self, path):
        self.path = os.fspath(path)
        self.num = 0
        if not os.path.exists(self.path):
            raise CaffeError("%s: no such %s database" % (self.path, self.label))

    def cursor(self):
        """Context manager for a :class:`Cursor` over a consistent view."""
        raise NotImplementedError

    def records(self, values=True):
        """Every (key, value) in key order, or every key when not ``values``
        (the values are then not read)."""
        with self.cursor() as cur:
            ok = cur.first()
            while ok:
                yield (bytes(cur.key()), bytes(cur.value())) if values else bytes(cur.key())
                ok = cur.next()

    def close(self):
        raise NotImplementedError

    def _not_a_database(self, missing):
        other = detect_backend(self.path)
        hint = " (it is %s: backend: %s)" % (_a(_CLASSES[other].label), other.upper()) if other else ""
        return CaffeError("%s: not %s database (no %s in the directory)%s"
                          % (self.path, _a(self.label), missing, hint))


def _a(label):
    return ("an " if label == "LMDB" else "a ") + label       # "an LMDB", "a LevelDB"


def _lmdb():
    try:
        import lmdb
        return lmdb
    except ImportError:
        raise CaffeError("reading LMDB needs the 'lmdb' package (pip install lmdb)") from None


def _plyvel():
    try:
        import plyvel
        return plyvel
    except ImportError:
        raise CaffeError("the LEVELDB backend needs the 'plyvel' package (pip install plyvel)") from None


class LMDB(Database):
    """An LMDB environment: a directory with data.mdb (or a .mdb file)."""
    label = "LMDB"

    def __init__(self, path):
        lmdb = _lmdb()
        super().__init__(path)
        subdir = os.path.isdir(self.path)
        if subdir and not os.path.exists(os.path.join(self.path, "data.mdb")):
            raise self._not_a_database("data.mdb")
        try:
            self._env = lmdb.open(self.path, readonly=True, lock=False, readahead=False,
                                  subdir=subdir, max_readers=256)
        except lmdb.Error as e:
            raise CaffeError("%s: cannot open LMDB database: %s" % (self.path, e)) from None
        self.num = self._env.stat()["entries"]

    @contextlib.contextmanager
    def cursor(self):
        with self._env.begin(buffers=False) as txn:
            yield txn.cursor()          # py-lmdb's cursor has first/next/key/value

    def close(self):
        self._env.close()


class _LevelDBCursor(Cursor):
    def __init__(self, iterator):
        self._it = iterator

    def first(self):
        self._it.seek_to_first()
        return self._it.valid()

    def next(self):
        self._it.next()
        return self._it.valid()

    def set_key(self, key):
        self._it.seek(key)
        return self._it.valid() and self._it.key() == key

    def key(self):
        return self._it.key()

    def value(self):
        return self._it.value()


class LevelDB(Database):
    """A LevelDB directory (CURRENT, MANIFEST-*, *.ldb/*.sst, *.log).

    LevelDB has no record count, so opening walks the keys once; and it
    lets one process at a time open a database, so when another holds it (a
    second MPI rank on the host) this process reads a private view: a new
    directory beside it with hard links to the files, which LevelDB never
    changes in place, removed on close."""
    label = "LevelDB"

    def __init__(self, path):
        super().__init__(path)
        if not os.path.isdir(self.path) or not os.path.exists(os.path.join(self.path, "CURRENT")):
            raise self._not_a_database("CURRENT file")      # plyvel would make one here
        plyvel = _plyvel()
        self._view = None
        try:
            self._db = plyvel.DB(self.path, create_if_missing=False, max_open_files=100)
        except plyvel.Error as e:
            if "IO error: lock " not in _text(e):      # LevelDB's words for "held elsewhere"
                raise CaffeError("%s: cannot open LevelDB database: %s" % (self.path, _text(e))) from None
            self._db = self._open_private_view()
        with self._db.iterator(include_value=False) as keys:
            self.num = sum(1 for _ in keys)         # LevelDB keeps no count

    def _open_private_view(self, attempts=3):
        plyvel = _plyvel()
        parent, name = os.path.split(os.path.abspath(self.path))
        for attempt in range(attempts):
            view = None
            try:
                view = tempfile.mkdtemp(prefix=".%s.view-" % name, dir=parent)
                for f in os.listdir(self.path):
                    if f not in ("LOCK", "LOG", "LOG.old"):
                        os.link(os.path.join(self.path, f), os.path.join(view, f))
                db = plyvel.DB(view, create_if_missing=False, max_open_files=100)
            except (OSError, plyvel.Error) as e:   # e.g. files compacted away meanwhile: try again
                if view is not None:
                    shutil.rmtree(view, ignore_errors=True)
                if attempt == attempts - 1:
                    raise CaffeError("%s: the LevelDB is open in another process and a private view of it "
                                     "beside it failed: %s" % (self.path, _text(e))) from None
                continue
            self._view = view
            log.info("%s: open in another process; reading it through %s", self.path, view)
            return db

    @contextlib.contextmanager
    def cursor(self):
        iterator = self._db.raw_iterator()      # reads a snapshot taken now
        try:
            yield _LevelDBCursor(iterator)
        finally:
            iterator.close()

    def close(self):
        self._db.close()
        if self._view is not None:
            shutil.rmtree(self._view, ignore_errors=True)
            self._view = None


def _text(error):
    """An error's message (plyvel's are bytes)."""
    arg = error.args[0] if len(error.args) == 1 else error
    if isinstance(arg, bytes):
        return arg.decode("utf-8", "replace")
    return getattr(error, "strerror", None) or str(arg)


_CLASSES = {"lmdb": LMDB, "leveldb": LevelDB}
_OPEN = {}          # (backend, real path) -> [Database, users]
_OPEN_LOCK = threading.Lock()


def open_read(path, backend="lmdb"):
    """The database at ``path`` opened read-only, shared within the process
    (give it back with :func:`release`).  CaffeError naming the path when it
    is missing, not such a database, or empty."""
    name = backend_name(backend)
    key = (name, os.path.realpath(path))
    with _OPEN_LOCK:
        if key in _OPEN:
            _OPEN[key][1] += 1
            db = _OPEN[key][0]
        else:
            db = _CLASSES[name](path)
            _OPEN[key] = [db, 1]
    if db.num == 0:
        release(db)
        raise CaffeError("%s: the database is empty" % db.path)
    return db


def release(db):
    """Give back a database from :func:`open_read` (closed when unused)."""
    with _OPEN_LOCK:
        for key, entry in list(_OPEN.items()):
            if entry[0] is db:
                entry[1] -= 1
                if entry[1] <= 0:
                    del _OPEN[key]
                    db.close()
                return


def read_all(path, backend=None):
    """[(key bytes, value bytes)] in key order (for tests and small tools);
    the backend is found from the files when not given."""
    db = open_read(path, backend or detect_backend(path) or "lmdb")
    try:
        return list(db.records())
    finally:
        release(db)


# ------------------------------------------------------------------ writing
class Writer:
    """Write (key, value) pairs into a new database (Caffe's db::NEW mode:
    the path must not exist yet), ``commit_every`` records per transaction.
    A context manager: closed (committed) on success, abandoned on error.
    Subclasses create the database in ``__init__`` and implement
    ``_write(pairs)``, ``_is_open()`` and ``_close()``."""
    label = None

    def __init__(self, path, commit_every=1000):
        self.path = os.fspath(path)
        if os.path.exists(self.path):
            raise CaffeError("%s: database already exists (remove it first)" % self.path)
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
        if self.pending:
            self._write(self.pending)
            self.pending = []

    def close(self):
        """Commit what is pending and close the database."""
        if self._is_open():
            self.commit()
            self._close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        elif self._is_open():
            self._close()

    def _cannot_create(self, error):
        return CaffeError("%s: cannot create %s database: %s" % (self.path, self.label, error))


class LMDBWriter(Writer):
    """A new LMDB; the map grows as needed (doubling on MDB_MAP_FULL)."""
    label = "LMDB"

    def __init__(self, path, map_size=1 << 26, commit_every=1000):
        lmdb = _lmdb()
        super().__init__(path, commit_every)
        try:
            os.makedirs(self.path)
            self.env = lmdb.open(self.path, map_size=map_size, subdir=True, meminit=False)
        except (OSError, lmdb.Error) as e:
            raise self._cannot_create(getattr(e, "strerror", None) or e) from None

    def _write(self, pairs):
        lmdb = _lmdb()
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    for k, v in pairs:
                        txn.put(k, v)
                return
            except lmdb.MapFullError:
                self.env.set_mapsize(self.env.info()["map_size"] * 2)

    def _is_open(self):
        return self.env is not None

    def _close(self):
        self.env.sync()
        self.env.close()
        self.env = None


class LevelDBWriter(Writer):
    """A new LevelDB, with the options of Caffe's db::LevelDB (64 KiB blocks,
    256 MiB write buffer, 100 open files)."""
    label = "LevelDB"

    def __init__(self, path, commit_every=1000):
        plyvel = _plyvel()
        super().__init__(path, commit_every)
        try:
            self.db = plyvel.DB(self.path, create_if_missing=True, error_if_exists=True,
                                block_size=65536, write_buffer_size=256 << 20, max_open_files=100)
        except plyvel.Error as e:
            raise self._cannot_create(_text(e)) from None

    def _write(self, pairs):
        with self.db.write_batch() as batch:
            for k, v in pairs:
                batch.put(k, v)

    def _is_open(self):
        return self.db is not None

    def _close(self):
        self.db.close()
        self.db = None


_WRITERS = {"lmdb": LMDBWriter, "leveldb": LevelDBWriter}


def open_writer(path, backend="lmdb"):
    """A :class:`Writer` for a new database of ``backend`` at ``path``."""
    return _WRITERS[backend_name(backend)](path)
