"""The LMDB names other modules and tests import; the implementation, for
LMDB and LevelDB alike, is :mod:`caffempi.data.db`."""
from .db import LMDBWriter, read_all

__all__ = ["LMDBWriter", "read_all"]
