"""caffempi: a Caffe-compatible, MPI data-parallel deep-learning trainer."""
from . import config  # noqa: F401  (caffempi.config.using_config)
from .backend import set_device, set_mode_cpu, set_mode_gpu
from .blob import Blob
from .common import TEST, TRAIN, CaffeError, set_random_seed
from .net import Net

__version__ = "0.1.0"
__all__ = ["Blob", "CaffeError", "Net", "TEST", "TRAIN", "set_random_seed", "set_mode_cpu",
           "set_mode_gpu", "set_device"]
from .solvers import (AdaDeltaSolver, AdaGradSolver, AdamSolver, NesterovSolver,  # noqa: E402
                      RMSPropSolver, SGDSolver, get_solver)
__all__ += ["get_solver", "SGDSolver", "NesterovSolver", "AdaGradSolver", "RMSPropSolver",
            "AdaDeltaSolver", "AdamSolver"]
