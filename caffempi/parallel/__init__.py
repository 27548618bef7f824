"""MPI data parallelism.  The world (comm), the collectives that are not
gradients (collectives), the gradient strategies (sync: BucketedAllreduce;
easgd: ElasticAveraging) and the transports that sum buffers (transports/),
job start-up and aborts (launch).  mpi4py is imported only when an MPI
launcher started the process."""
from .collectives import Collectives  # noqa: F401
from .comm import SingleWorld, get_world, launched_by_mpi  # noqa: F401
from .sync import BucketedAllreduce, GradientSync  # noqa: F401
from .transports import COMM_MODES, make_transport  # noqa: F401
