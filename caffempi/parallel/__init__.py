"""MPI data parallelism: the world (comm), the gradient reducer and its
transports (reducer), job start-up and aborts (launch), elastic averaging
(easgd).  mpi4py is imported only when an MPI launcher started the process."""
from .comm import get_world, launched_by_mpi, SingleWorld  # noqa: F401
from .reducer import (COMM_MODES, DEFAULT_BUCKET_MB, Reducer, make_buckets,  # noqa: F401
                      make_reducer, make_transport)
