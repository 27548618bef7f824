"""Layers that read data sets: Data (LMDB or LevelDB of Caffe Datums), ImageData (an
image list), HDF5Data and MemoryData (arrays fed from Python); HDF5Output,
which writes its bottoms to an HDF5 file.

Every layer reads its rank's share (``data_shard`` = (rank, size)): stream
positions p with p mod size == rank, batch by batch, so R ranks × batch b see
each iteration exactly the records one process × batch R·b sees (Caffe's
multi-GPU rule); under uneven batch shares (``set_batch_shares``, from
--balance) each rank reads its count of those records, a contiguous run
(``reader.shard_positions``), from the next batch on.  Random choices (crop, mirror, shuffles, rand_skip) derive
from a seed drawn from ``caffempi.common.rng()`` at setup and the batch or
epoch index, never from thread timing, so ``get_state()`` (batch counter,
seed, skip) and ``set_state()`` resume a run bitwise.
"""
import os
import time

import numpy as np

from ..backend import on_host, to_numpy
from ..common import CaffeError, rng, log
from ..data import db
from ..data.datum import datum_to_array, parse_datum, pil_to_chw, raw_datum_batch
from ..data.image_list import read_image_list
from ..data.reader import BatchPrefetcher, db_producer, shard_columns, shard_positions
from ..data.transformer import DataTransformer
from ..io.atomic import atomic_path
from .base import Layer, register


def _key_str(key):
    try:
        return bytes(key).decode("ascii")
    except UnicodeDecodeError:
        return repr(bytes(key))


class _BatchDataLayer(Layer):
    """Common part: tops data (N×C×H×W) and optional label (N), a batch
    counter, a seed, a threaded prefetcher and wait-time accounting."""
    exact_num_bottom = 0
    min_top = 1
    max_top = 2
    samplewise = True

    wait_seconds = 0.0

    def _init_state(self, rand_skip=0):
        r = rng()
        self._seed = int(r.randint(0, 2 ** 31 - 1))
        self._skip = int(r.randint(0, rand_skip)) if rand_skip else 0
        if self._skip:
            log.info("%s: skipping first %d data points", self.name, self._skip)
        self._batch = 0
        self._prefetcher = None
        self._schedule = [(0, None)]     # (first batch, shares): what the reader reads, by batch
        self.wait_seconds = 0.0

    def get_state(self):
        return {"batch": int(self._batch), "seed": int(self._seed), "skip": int(self._skip)}

    def set_state(self, state):
        self._stop_reader()
        self._batch = int(state["batch"])
        self._seed = int(state.get("seed", self._seed))
        self._skip = int(state.get("skip", self._skip))

    def _stop_reader(self):
        if getattr(self, "_prefetcher", None) is not None:
            self._prefetcher.stop()

    def share_batch(self):
        return self.batch_size

    def shares_at(self, k):
        """The shares of batch ``k`` by the schedule (read by the reader
        threads: entries are only added, and the list replaced whole)."""
        for first, shares in reversed(list(self._schedule)):
            if first <= k:
                return shares
        return None

    def share_lookahead(self):
        # the ready queue, the batch in the producer's hand, and the GPU's upload of the next
        return self.prefetch + 3

    def schedule_batch_shares(self, shares, ahead):
        if ahead >= self.share_lookahead():    # else the reader may have read that batch: it restarts then
            self._schedule.append((self._batch + ahead, shares))

    def set_batch_shares(self, shares):
        """Shares that the schedule announced cost nothing; others restart
        the reader at the next batch (what it prefetched under the old ones
        is dropped, not consumed)."""
        if shares != self.shares_at(self._batch):
            self._stop_reader()
            self._schedule = [(self._batch, shares)]
        else:
            self._schedule = [(self._batch, shares)] + [e for e in self._schedule if e[0] > self._batch]
        super().set_batch_shares(shares)

    def close(self):
        """Stop the reader threads and release the source."""
        self._stop_reader()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def reshape(self, bottom, top):
        n = self.rank_batch(self.batch_size)
        top[0].reshape((n,) + tuple(self._item_shape))
        if len(top) > 1:
            top[1].reshape((n,))

    def _set_tops(self, top, data, labels):
        top[0].reshape(data.shape)
        top[0].data = self.xp.asarray(data, self.dtype)
        if len(top) > 1:
            top[1].reshape(labels.shape)
            top[1].data = self.xp.asarray(labels, self.dtype)

    def forward(self, bottom, top):
        t0 = time.perf_counter()
        if self._prefetcher is None or not self._prefetcher.running:
            self._prefetcher = self._make_prefetcher()
            self._prefetcher.start(self._batch)
            self._uploader = None
        if on_host(self.xp):
            data, labels = self._prefetcher.next()
        else:
            # GPU: the workers fill pinned host batches (transformer.empty)
            # and the next batch's upload runs on a side stream during this
            # iteration's compute
            from ..backend import gpu
            self.transformer.empty = gpu.empty_pinned
            if self._uploader is None:
                self._uploader = gpu.BatchUploader(self._prefetcher.next)
            data, labels = self._uploader.next()
        self.wait_seconds += time.perf_counter() - t0
        self._batch += 1
        self._set_tops(top, data, labels)

    def backward(self, top, propagate_down, bottom):
        """Data layers have no bottoms."""

    def _draws(self, k):
        if not self.transformer.needs_draws:     # no mirror, no train-time crop: nothing to draw
            return None
        rank, size = self.data_shard
        return DataTransformer.draws(self._seed, k, self.batch_size * size,
                                     shard_columns(self.batch_size, rank, size, self.shares_at(k)))


@register("Data")
class DataLayer(_BatchDataLayer):
    """Caffe's Data layer over an LMDB or a LevelDB of Datums (raw,
    float_data or encoded).  Without ``backend`` the source's files tell,
    else Caffe's default, LEVELDB.

    NVCaffe's data_param: ``threads`` sets this layer's decode threads;
    ``shuffle`` with ``cache`` reads every epoch after the first (which
    NVCaffe reads in key order while caching) in a random order, seeking each
    record by key (the keys are held in memory, not the records: the OS
    caches those); ``shuffle`` without ``cache`` is ignored, as in NVCaffe."""

    def setup(self, bottom, top):
        p = self.param.data_param
        self.source = p.source
        if not p.source:
            raise self.error("data_param.source is not set")
        self.batch_size = int(p.batch_size)
        if self.batch_size <= 0:
            raise self.error("data_param.batch_size must be positive")
        backend = p.backend if p.HasField("backend") else (db.detect_backend(p.source) or p.backend)
        self.prefetch = int(p.prefetch) or 1
        self.workers = int(p.threads) or None
        self.transformer = DataTransformer(self.param.transform_param, self.phase,
                                           "layer '%s' (Data, %s): " % (self.name, p.source))
        try:
            self._db = db.open_read(p.source, backend)
        except CaffeError as e:
            raise self.error("%s", e)
        self._init_state(int(p.rand_skip))
        try:
            self._keys = None
            if p.shuffle and p.cache:
                self._keys = list(self._db.records(values=False))
            elif p.shuffle:
                log.warning("layer '%s': data_param shuffle is ignored without cache: true (as in NVCaffe)",
                            self.name)
            with self._db.cursor() as cur:
                cur.first()
                key, value = cur.key(), cur.value()
            arr, _ = self._decode(key, value)
            self._item_shape = self.transformer.output_shape(arr.shape)
        except BaseException:
            self.close()
            raise

    def _shuffled(self, epoch):
        """(keys, permutation) of ``epoch`` for the reader, None for key
        order (epoch 0).  The permutation is seeded by the epoch alone: the
        same on every rank, whose shards so stay disjoint, and in every run."""
        if epoch == 0:
            return None
        return self._keys, np.random.RandomState([0x5EED, 0xDB, epoch]).permutation(len(self._keys))

    def _decode(self, key, value):
        where = "%s key '%s'" % (self.source, _key_str(key))
        d = parse_datum(value, where)
        t = self.transformer
        return datum_to_array(d, t.force_color, t.force_gray, where), d.label

    def close(self):
        super().close()
        source, self._db = getattr(self, "_db", None), None
        if source is not None:
            db.release(source)

    def _make_prefetcher(self):
        rank, size = self.data_shard
        produce = db_producer(self._db, self.batch_size, rank, size, self._skip,
                              self._shuffled if self._keys is not None else None, self.shares_at)
        return BatchPrefetcher("%s(%s)" % (self.name, self.source), produce, self._process, self.prefetch,
                               self.workers)

    def _process(self, k, recs):
        batch = raw_datum_batch([value for _, value in recs])
        if batch is not None:
            return self.transformer.transform(batch[0], self._draws(k)), batch[1]
        imgs, labels = [], np.empty(len(recs), np.float32)
        for j, (key, value) in enumerate(recs):
            arr, labels[j] = self._decode(key, value)
            imgs.append(arr)
        shape = imgs[0].shape
        for (key, _), a in zip(recs, imgs):
            if a.shape != shape:
                raise CaffeError("%s key '%s': record is %s but the batch's first record is %s"
                                 % (self.source, _key_str(key), "x".join(map(str, a.shape)),
                                    "x".join(map(str, shape))))
        return self.transformer.transform(imgs, self._draws(k)), labels


@register("ImageData")
class ImageDataLayer(_BatchDataLayer):
    """Images named in a list file (``path label`` per line), read with Pillow,
    resized to new_height×new_width when both are set, then transformed."""

    def setup(self, bottom, top):
        p = self.param.image_data_param
        self.source = p.source
        self.batch_size = int(p.batch_size)
        if self.batch_size <= 0:
            raise self.error("image_data_param.batch_size must be positive")
        if (p.new_height > 0) != (p.new_width > 0):
            raise self.error("new_height and new_width must be set together")
        self.new_size = (int(p.new_height), int(p.new_width))
        self.is_color = bool(p.is_color)
        self.root = p.root_folder
        self.shuffle = bool(p.shuffle)
        self.prefetch = 4
        self.lines = read_image_list(p.source, self)
        self.transformer = DataTransformer(self.param.transform_param, self.phase,
                                           "layer '%s' (ImageData, %s): " % (self.name, p.source))
        self._init_state(int(p.rand_skip))
        first = self._record(0)
        raw = self._read(first)
        arr = self._decode(first, raw)
        self._item_shape = self.transformer.output_shape(arr.shape)

    def _order(self, epoch):
        if not self.shuffle:
            return None
        cached = getattr(self, "_order_cache", None)
        if cached is not None and cached[0] == (self._seed, epoch):
            return cached[1]
        order = np.random.RandomState([self._seed, 0x5EED, epoch]).permutation(len(self.lines))
        self._order_cache = ((self._seed, epoch), order)
        return order

    def _record(self, pos):
        q = pos + self._skip
        n = len(self.lines)
        e, i = divmod(q, n)
        order = self._order(e)
        return self.lines[int(order[i]) if order is not None else i]

    def _read(self, rec):
        path, label, lineno = rec
        full = os.path.join(self.root, path) if self.root else path
        try:
            with open(full, "rb") as f:
                return f.read()
        except OSError as e:
            raise CaffeError("layer '%s' (ImageData): %s line %d: cannot read image %s: %s"
                             % (self.name, self.source, lineno, full, e.strerror or e)) from None

    def _decode(self, rec, raw):
        from PIL import Image
        import io
        path, label, lineno = rec
        where = "layer '%s' (ImageData): %s line %d: image %s" % (self.name, self.source, lineno, path)
        try:
            with Image.open(io.BytesIO(raw)) as img:
                img.load()
                if self.new_size[0] > 0:
                    img = img.convert("RGB" if self.is_color else "L").resize(
                        (self.new_size[1], self.new_size[0]), Image.BILINEAR)
                return pil_to_chw(img, self.is_color)
        except Exception as e:
            raise CaffeError("%s: cannot decode (%s)" % (where, e)) from None

    def _make_prefetcher(self):
        rank, size = self.data_shard
        bs = self.batch_size

        def produce(start, stopped):
            k = start
            while not stopped():
                recs = []
                for p in shard_positions(k, bs, rank, size, self.shares_at(k)):
                    rec = self._record(p)
                    recs.append((rec, self._read(rec)))
                yield k, recs
                k += 1
        return BatchPrefetcher("%s(%s)" % (self.name, self.source), produce, self._process, self.prefetch)

    def _process(self, k, recs):
        imgs = [self._decode(rec, raw) for rec, raw in recs]
        labels = np.asarray([rec[1] for rec, _ in recs], np.float32)
        return self.transformer.transform(imgs, self._draws(k)), labels


@register("HDF5Data")
class HDF5DataLayer(Layer):
    """Rows of the HDF5 datasets named by the tops, from the .h5 files listed in
    ``source`` (one file in memory at a time, as Caffe).  ``shuffle`` permutes
    the file order and the rows of each file, anew every epoch."""
    exact_num_bottom = 0
    min_top = 1
    samplewise = True
    wait_seconds = 0.0

    def setup(self, bottom, top):
        import h5py
        p = self.param.hdf5_data_param
        self.source = p.source
        self.batch_size = int(p.batch_size)
        if self.batch_size <= 0:
            raise self.error("hdf5_data_param.batch_size must be positive")
        self.shuffle = bool(p.shuffle)
        self.names = list(self.param.top)
        try:
            with open(p.source) as f:
                files = [l.strip() for l in f if l.strip()]
        except OSError as e:
            raise self.error("cannot read HDF5 file list %s: %s", p.source, e.strerror or e)
        if not files:
            raise self.error("HDF5 file list %s names no files", p.source)
        base = os.path.dirname(os.path.abspath(p.source))
        self.files = []
        self.rows = []
        shapes = None
        for fn in files:
            path = fn if os.path.exists(fn) or os.path.isabs(fn) else os.path.join(base, fn)
            try:
                with h5py.File(path, "r") as h:
                    sh = []
                    for name in self.names:
                        if name not in h:
                            raise self.error("%s has no dataset '%s' (datasets: %s)", path, name,
                                             ", ".join(h.keys()))
                        sh.append(tuple(h[name].shape))
            except OSError as e:
                raise self.error("cannot read HDF5 file %s (listed in %s): %s", path, p.source, e)
            n = sh[0][0] if sh[0] else 0
            for name, s in zip(self.names, sh):
                if not s or s[0] != n:
                    raise self.error("%s: dataset '%s' has %s rows, '%s' has %d", path, name,
                                     s[0] if s else 0, self.names[0], n)
            if shapes is None:
                shapes = [s[1:] for s in sh]
            elif shapes != [s[1:] for s in sh]:
                raise self.error("%s: dataset shapes %s differ from the first file's %s", path,
                                 [s[1:] for s in sh], shapes)
            self.files.append(path)
            self.rows.append(n)
        self.total = sum(self.rows)
        if self.total == 0:
            raise self.error("the HDF5 files listed in %s hold no rows", p.source)
        self.item_shapes = shapes
        r = rng()
        self._seed = int(r.randint(0, 2 ** 31 - 1))
        self._batch = 0
        self._loaded = (None, None)
        self.wait_seconds = 0.0

    def get_state(self):
        return {"batch": int(self._batch), "seed": int(self._seed)}

    def set_state(self, state):
        self._batch = int(state["batch"])
        self._seed = int(state.get("seed", self._seed))

    def share_batch(self):
        return self.batch_size

    def reshape(self, bottom, top):
        for t, s in zip(top, self.item_shapes):
            t.reshape((self.rank_batch(self.batch_size),) + tuple(s))

    def _file(self, f):
        import h5py
        if self._loaded[0] != f:
            with h5py.File(self.files[f], "r") as h:
                arrays = [np.asarray(h[n], np.float32 if self.dtype == np.float32 else self.dtype)
                          for n in self.names]
            self._loaded = (f, arrays)
        return self._loaded[1]

    def forward(self, bottom, top):
        t0 = time.perf_counter()
        rank, size = self.data_shard
        out = [np.empty((self.rank_batch(self.batch_size),) + tuple(s), self.dtype) for s in self.item_shapes]
        for j, p in enumerate(shard_positions(self._batch, self.batch_size, rank, size, self.batch_shares)):
            f, row, e = self._locate_fast(p)
            arrays = self._file(f)
            for o, a in zip(out, arrays):
                o[j] = a[row]
        self._batch += 1
        self.wait_seconds += time.perf_counter() - t0
        for t, o in zip(top, out):
            t.reshape(o.shape)
            t.data = self.xp.asarray(o)

    def _locate_fast(self, pos):
        """_locate with the row permutation of the current (epoch, file) cached."""
        e, q = divmod(pos, self.total)
        nf = len(self.files)
        if getattr(self, "_order_key", None) != e:
            self._order = (np.random.RandomState([self._seed, 0xF11E, e]).permutation(nf)
                           if self.shuffle and nf > 1 else np.arange(nf))
            self._order_key = e
        for f in self._order:
            f = int(f)
            if q < self.rows[f]:
                if not self.shuffle:
                    return f, q, e
                if getattr(self, "_perm_key", None) != (e, f):
                    self._perm = np.random.RandomState([self._seed, 0x5707, e, f]).permutation(self.rows[f])
                    self._perm_key = (e, f)
                return f, int(self._perm[q]), e
            q -= self.rows[f]
        raise AssertionError("unreachable")

    def backward(self, top, propagate_down, bottom):
        """No bottoms."""


@register("HDF5Output")
class HDF5OutputLayer(Layer):
    """Writes bottom 0 as dataset "data" and bottom 1 as "label" to the HDF5
    file ``hdf5_output_param.file_name``, each 4-D in Caffe's legacy N x C x
    H x W (missing axes 1, at most 4 axes), in the net's float type.  The
    file is created empty at setup (Caffe truncates it there) and each
    forward replaces it atomically with that batch: Caffe writes the first
    batch and then fails, since its datasets exist already (BVLC/caffe#1726);
    here the latest batch wins.  No tops; the bottoms' gradient is zero."""
    backward_reads_bottom_data = False
    backward_reads_top_data = False
    exact_num_bottom = 2
    exact_num_top = 0

    def setup(self, bottom, top):
        self.file_name = self.param.hdf5_output_param.file_name
        if not self.file_name:
            raise self.error("hdf5_output_param.file_name is not set")
        self._write({})

    def reshape(self, bottom, top):
        for i, b in enumerate(bottom):
            if not 1 <= b.num_axes <= 4:
                raise self.error("bottom %d has shape %s; HDF5 output takes 1 to 4 axes "
                                 "(Caffe's N x C x H x W)", i, b.shape)
        if bottom[0].shape[0] != bottom[1].shape[0]:
            raise self.error("data (bottom 0, shape %s) and label (bottom 1, shape %s) must have "
                             "the same number of items", bottom[0].shape, bottom[1].shape)

    def forward(self, bottom, top):
        self._write({name: np.asarray(to_numpy(b.data), self.dtype).reshape(
            b.shape + (1,) * (4 - b.num_axes)) for name, b in zip(("data", "label"), bottom)})

    def _write(self, datasets):
        import h5py
        try:
            with atomic_path(self.file_name) as tmp:
                with h5py.File(tmp, "w") as f:
                    for name, arr in datasets.items():
                        f.create_dataset(name, data=arr)
        except OSError as e:
            raise self.error("cannot write HDF5 file %s: %s", self.file_name, e.strerror or e) from None

    def backward(self, top, propagate_down, bottom):
        for b, prop in zip(bottom, propagate_down):
            if prop:
                b.diff = self.xp.zeros(b.shape, self.dtype)


@register("MemoryData")
class MemoryDataLayer(Layer):
    """Batches of arrays given from Python with :meth:`reset` (pycaffe's
    ``net.set_input_arrays(data, labels)``)."""
    exact_num_bottom = 0
    exact_num_top = 2
    samplewise = True
    wait_seconds = 0.0

    def setup(self, bottom, top):
        p = self.param.memory_data_param
        self.batch_size = int(p.batch_size)
        self.shape = (int(p.channels), int(p.height), int(p.width))
        if self.batch_size <= 0 or min(self.shape) <= 0:
            raise self.error("memory_data_param needs positive batch_size, channels, height and width")
        self._data = None
        self._labels = None
        self._batch = 0

    def reset(self, data, labels):
        """Use ``data`` (N×C×H×W) and ``labels`` (N, or N×1×1×1); N must be a
        multiple of batch_size.  Restarts at the first batch."""
        data = np.asarray(data)
        labels = np.asarray(labels).reshape(-1)
        if data.ndim != 4 or tuple(data.shape[1:]) != self.shape:
            raise self.error("data must be N x %d x %d x %d, got %s", *(self.shape + (data.shape,)))
        if labels.shape[0] != data.shape[0]:
            raise self.error("%d labels for %d images", labels.shape[0], data.shape[0])
        if data.shape[0] == 0 or data.shape[0] % self.batch_size:
            raise self.error("the number of images (%d) must be a positive multiple of batch_size %d",
                             data.shape[0], self.batch_size)
        self._data = data
        self._labels = labels
        self._batch = 0

    set_input_arrays = reset

    def get_state(self):
        return {"batch": int(self._batch)}

    def set_state(self, state):
        self._batch = int(state["batch"])

    def share_batch(self):
        return self.batch_size

    def reshape(self, bottom, top):
        n = self.rank_batch(self.batch_size)
        top[0].reshape((n,) + self.shape)
        top[1].reshape((n,))

    def forward(self, bottom, top):
        if self._data is None:
            raise self.error("no data: call reset(data, labels) (set_input_arrays) first")
        rank, size = self.data_shard
        n = self._data.shape[0]
        idx = np.asarray(shard_positions(self._batch, self.batch_size, rank, size, self.batch_shares)) % n
        self._batch += 1
        top[0].data = self.xp.asarray(self._data[idx], self.dtype)
        top[1].data = self.xp.asarray(self._labels[idx], self.dtype)

    def backward(self, top, propagate_down, bottom):
        """No bottoms."""
