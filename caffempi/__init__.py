"""caffempi: a Caffe-compatible, MPI data-parallel deep-learning trainer."""
from . import config  # noqa: F401  (caffempi.config.using_config)
from .backend import set_device, set_mode_cpu, set_mode_gpu
from .blob import Blob
from .common import TEST, TRAIN, CaffeError, set_random_seed
from .net import Net

__version__ = "0.1.0"
__all__ = ["Blob", "CaffeError", "Net", "TEST", "TRAIN", "set_random_seed", "set_mode_cpu",
           "set_mode_gpu", "set_device"]
from .pycaffe import (AdaDeltaSolver, AdaGradSolver, AdamSolver, NesterovSolver,  # noqa: E402
                      RMSPropSolver, SGDSolver, get_solver)
__all__ += ["get_solver", "SGDSolver", "NesterovSolver", "AdaGradSolver", "RMSPropSolver",
            "AdaDeltaSolver", "AdamSolver"]
from .classifier import Classifier  # noqa: E402  (pycaffe's caffe.Classifier)
__all__ += ["Classifier"]
from .detector import Detector  # noqa: E402  (pycaffe's caffe.Detector)
__all__ += ["Detector"]
from .layer_types.base import LAYER_REGISTRY  # noqa: E402
from .layer_types.python import Layer  # noqa: E402  (pycaffe's caffe.Layer, for Python layers)
from .net_spec import NetSpec, layers, params, to_proto  # noqa: E402  (pycaffe's NetSpec, L and P)
from . import coord_map  # noqa: E402  (pycaffe's caffe.coord_map: coord_map_from_to, crop)
__all__ += ["Layer", "NetSpec", "layers", "params", "to_proto", "layer_type_list", "coord_map"]
from .pycaffe import (NCCL, Timer, has_nccl, init_log, log, set_multiprocess,  # noqa: E402
                      set_solver_count, set_solver_rank, solver_count, solver_rank)
__all__ += ["Timer", "init_log", "log", "solver_count", "set_solver_count", "solver_rank", "set_solver_rank",
            "set_multiprocess", "has_nccl", "NCCL"]


def layer_type_list():
    """pycaffe's layer_type_list: the registered layer type names, sorted."""
    return sorted(LAYER_REGISTRY)
