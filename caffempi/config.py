"""Every ``CAFFEMPI_*`` environment variable, read in this one place.

The values are read from the environment once, on first use, and are then
attributes of :data:`settings` (Chainer's ``global_config``); code may
override them for a block with :func:`using_config`, as tests and the CLI do.
docs/configuration.md lists them for users.

| variable | attribute | default | meaning |
|---|---|---|---|
| CAFFEMPI_MPI | mpi | None | 1: initialise MPI even without a launcher; 0: never (one process); unset: MPI when a launcher started the process |
| CAFFEMPI_MPIEXEC | mpiexec | None | the mpiexec that --ranks and the tools start ranks with; unset: the one beside this Python, else on PATH |
| CAFFEMPI_DATA_WORKERS | data_workers | 2 | decode/transform threads per data layer |
| CAFFEMPI_MALLOC_TUNE | malloc_tune | True | the CLI's allocator tuning and huge-page heap re-exec |
| CAFFEMPI_CUDNN | cudnn | True | GPU convolutions with engine DEFAULT use cuDNN when it loads |
| CAFFEMPI_CUDNN_DETERMINISTIC | cudnn_deterministic | False | cuDNN may pick only bit-reproducible algorithms |
| CAFFEMPI_TF32 | tf32 | False | cuDNN convolutions may use TF32 tensor cores |
| CAFFEMPI_FTZ | ftz | True | the computing threads flush denormal floats to zero (x86) |
| CAFFEMPI_DIRECT_CONV | direct_conv | True | CPU convolutions may use the compiled direct kernel (backend/direct.py) where it is the faster |
| CAFFEMPI_COMPILED_POOLING | compiled_pooling | True | CPU MAX pooling uses the compiled kernels (backend/pooling.py) where they run |
| CAFFEMPI_COMPILED_CHANNELS | compiled_channels | True | BatchNorm and per-channel Scale passes use the compiled kernels (backend/channels.py on the CPU, backend/gpu_channels.py on the GPU) where they run |
| CAFFEMPI_FUSE | fuse | True | nets run BatchNorm → Scale → ReLU and Eltwise SUM → ReLU chains in place as one pass each way (Layer.absorb) |
| CAFFEMPI_CUDA_GRAPH | cuda_graph | False | GPU training replays each iteration's pass and update as captured CUDA graphs (solvers/captured.py) |

A value that cannot be read is a one-line CaffeError naming the variable
(raised where the setting is first used, so the CLI reports it as any other
bad input).
"""
import contextlib
import os

from .common import CaffeError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _flag(var, text):
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise CaffeError("%s=%r: expected 1 or 0" % (var, text))


def _optional_flag(var, text):
    return None if not text.strip() else _flag(var, text)


def _optional_path(var, text):
    return text.strip() or None


def _positive_int(var, text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise CaffeError("%s=%r: expected a positive integer" % (var, text))
    return value


# attribute -> (environment variable, parser, default when unset)
SETTINGS = {
    "mpi": ("CAFFEMPI_MPI", _optional_flag, None),
    "mpiexec": ("CAFFEMPI_MPIEXEC", _optional_path, None),
    "data_workers": ("CAFFEMPI_DATA_WORKERS", _positive_int, 2),
    "malloc_tune": ("CAFFEMPI_MALLOC_TUNE", _flag, True),
    "cudnn": ("CAFFEMPI_CUDNN", _flag, True),
    "cudnn_deterministic": ("CAFFEMPI_CUDNN_DETERMINISTIC", _flag, False),
    "tf32": ("CAFFEMPI_TF32", _flag, False),
    "ftz": ("CAFFEMPI_FTZ", _flag, True),
    "direct_conv": ("CAFFEMPI_DIRECT_CONV", _flag, True),
    "compiled_pooling": ("CAFFEMPI_COMPILED_POOLING", _flag, True),
    "compiled_channels": ("CAFFEMPI_COMPILED_CHANNELS", _flag, True),
    "fuse": ("CAFFEMPI_FUSE", _flag, True),
    "cuda_graph": ("CAFFEMPI_CUDA_GRAPH", _flag, False),
}


class Config:
    """The settings of one environment, parsed lazily, one attribute each.
    Values set on the object (:func:`using_config`) take precedence."""

    def __init__(self, environ=None):
        self._environ = environ
        self._values = {}

    def __getattr__(self, name):
        if name.startswith("_") or name not in SETTINGS:
            raise AttributeError(name)
        if name not in self._values:
            var, parse, default = SETTINGS[name]
            env = os.environ if self._environ is None else self._environ
            self._values[name] = parse(var, env[var]) if var in env else default
        return self._values[name]

    def __setattr__(self, name, value):
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        elif name in SETTINGS:
            self._values[name] = value
        else:
            raise AttributeError("no setting '%s' (one of %s)" % (name, ", ".join(SETTINGS)))


def read(environ):
    """The settings of the environment mapping ``environ`` (a child process's,
    say), parsed with the same rules as :data:`settings`."""
    return Config(dict(environ))


settings = Config()


@contextlib.contextmanager
def using_config(**values):
    """Override settings inside the block: ``with using_config(tf32=True): ...``."""
    missing = object()
    old = {}
    for name, value in values.items():
        old[name] = settings._values.get(name, missing)
        setattr(settings, name, value)
    try:
        yield settings
    finally:
        for name, value in old.items():
            if value is missing:
                settings._values.pop(name, None)
            else:
                settings._values[name] = value


def use_cudnn(engine):
    """Whether a layer whose prototxt ``engine`` is ``engine`` (Caffe's Engine
    enum: DEFAULT 0, CAFFE 1, CUDNN 2) should run cuDNN's kernels on the GPU:
    CAFFE never, CUDNN always (where cuDNN loads), DEFAULT as
    ``settings.cudnn`` says (Caffe builds with cuDNN prefer it likewise).
    Only Convolution and Deconvolution have cuDNN kernels in this build:
    Pooling, ReLU, Sigmoid, TanH, Softmax and LRN run ours whatever their
    engine."""
    if engine == 1:
        return False
    if engine == 2:
        return True
    return bool(settings.cudnn)
