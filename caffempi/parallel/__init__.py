"""MPI data parallelism.  The world (comm), the collectives that are not
gradients (collectives), the gradient strategies (sync: BucketedAllreduce
and its plug-ins, sfb: SufficientFactors; easgd: ElasticAveraging), the
compressors (compression) and the transports that sum buffers
(transports/), the run's settings (config: ParallelConfig), a rank's
start-up and aborts (rank) and the start of a job from one command
(launch).  mpi4py is imported only when an MPI launcher started the
process.  docs/architecture.md draws how they meet."""
from .collectives import Collectives  # noqa: F401
from .comm import SingleWorld, get_world, launched_by_mpi  # noqa: F401
from .config import ParallelConfig  # noqa: F401
from .sync import BucketedAllreduce, GradientSync, ReducerPlugin  # noqa: F401
from .transports import COMM_MODES, make_transport  # noqa: F401
