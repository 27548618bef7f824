"""Generated data sets for tests and benchmarks."""
import numpy as np

from ..data.datum import array_to_datum
from ..data.lmdb_io import LMDBWriter


def random_datum_lmdb(path, shape, count, seed=0):
    """An LMDB of ``count`` raw Datums of uniformly random uint8 pixels of
    C×H×W ``shape`` and labels in 0..9, keyed by 8-digit index, as Caffe's
    converters write them."""
    rs = np.random.RandomState(seed)
    images = rs.randint(0, 256, (count,) + tuple(shape)).astype(np.uint8)
    labels = rs.randint(0, 10, count)
    with LMDBWriter(str(path)) as w:
        for i, (image, label) in enumerate(zip(images, labels)):
            w.put("%08d" % i, array_to_datum(image, int(label)).SerializeToString())
