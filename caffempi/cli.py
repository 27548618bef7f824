"""``caffempi <command> [flags]``: the caffe binary's commands and flags
(tools/caffe.cpp): train, test, time, device_query.

Flags are gflags style (caffempi.flags): ``--flag=value``, ``--flag value``,
``-flag value`` and ``-flag=value``; boolean flags also as ``--flag`` /
``--noflag``; ``--flagfile``, ``--help``, ``--version`` and glog's flags
(``--log_dir``, ``--minloglevel`` ...).  A flag is one ``FLAGS.define``
line; a command is one ``COMMANDS`` entry.

``train --ranks=N`` (or a ``--gpu`` list) without a launcher runs the same
command line on N ranks under mpiexec (parallel.launch.run_under_mpiexec).

Errors a user can cause (CaffeError, ProtoError, OSError, KeyboardInterrupt)
print ``caffempi: error: <message>`` on one line and exit 1 (under MPI: that
rank's line, then MPI_Abort; an AgreedError, raised on every rank together:
rank 0's line, and every rank exits 1); ``--debug`` shows the traceback
instead.
"""
import os
import signal
import sys
from collections import OrderedDict

from .common import AgreedError, CaffeError, TEST, configure_logging, log, printable
from .flags import FlagSet
from .io.proto_io import ProtoError
from .memory import tune_allocator

PROG = "caffempi"

FLAGS = FlagSet(PROG, "command line brew", usage="%s <command> <args>" % PROG)
FLAGS.argument("command", "train: train or finetune a model; test: score a model; device_query: show GPU "
               "diagnostic information; time: benchmark model execution time; help: this text", default=None)
FLAGS.define("solver", "", "The solver definition protocol buffer text file.")
FLAGS.define("model", "", "The model definition protocol buffer text file.")
FLAGS.define("phase", "", "Optional; network phase (TRAIN or TEST). Only used for 'time'.")
FLAGS.define("level", 0, "Optional; network level.")
FLAGS.define("stage", "", "Optional; network stages (not to be confused with phase), separated by ','.")
FLAGS.define("snapshot", "", "Optional; the snapshot solver state to resume training.")
FLAGS.define("weights", "", "Optional; the pretrained weights to initialize finetuning, separated by ','. "
             "Cannot be set simultaneously with snapshot. For 'train' they replace the solver's weights.")
FLAGS.define("gpu", "", "Optional; run in GPU mode on given device IDs separated by ','. "
             "Use '-gpu all' to run on all available GPUs. For 'train' without a launcher, a list runs "
             "one rank per device under mpiexec.")
FLAGS.define("iterations", 50, "The number of iterations to run.")
FLAGS.define("sigint_effect", "stop", "Optional; action to take when a SIGINT signal is received: "
             "snapshot, stop or none.")
FLAGS.define("sighup_effect", "snapshot", "Optional; action to take when a SIGHUP signal is received: "
             "snapshot, stop or none.")
FLAGS.define("sigterm_effect", "snapshot", "Optional; action to take when a SIGTERM signal is received "
             "(what schedulers send before killing a job): snapshot (write one snapshot after the current "
             "iteration, then stop), stop or none.")
FLAGS.define("data_shape", "", "Optional; for 'time': C,H,W of images from a data layer whose source "
             "cannot be read and whose prototxt does not say the size.")
FLAGS.define("debug", False, "Show Python tracebacks instead of one-line errors.")
FLAGS.define("memory", "reuse", "Optional; activation memory plan: none, reuse or recompute (offload needs a GPU).")
# MPI data parallelism: --ranks, --comm, --bucket_mb, --sync, --tau, --alpha ...
from .parallel.config import ParallelConfig  # noqa: E402
ParallelConfig.define_flags(FLAGS.define)


def parse_args(argv):
    """(command or None, Flags) from the argument list; the command
    ``help`` sets flags.help."""
    flags, arguments = FLAGS.parse(argv)
    command = arguments[0] if arguments else None
    if command == "help":
        command, flags.help = None, True
    return command, flags


# ----------------------------------------------------------------- helpers
def get_stages(flags):
    return [s for s in flags.stage.split(",") if s] if flags.stage else []


def select_backend(flags, solver_param=None, world=None):
    """The array module for this run: CuPy on --gpu (or solver_mode: GPU
    when CuPy works), else NumPy.  Under mpirun, ``--gpu=all`` or a list of
    ids gives each rank the GPU of its local rank (the ranks on its host,
    MPI's shared-memory split): all GPUs, or the list's entry, round robin.
    A single id puts every rank on that GPU."""
    import numpy as np
    from .backend import check_device_id, cupy_or_none, parse_gpu_ids, usable_cupy
    local_rank = world.local_rank()[0] if world is not None else 0
    gpu = flags.gpu
    if not gpu and solver_param is not None and solver_param.HasField("solver_mode") \
            and solver_param.solver_mode == solver_param.GPU:
        if cupy_or_none() is None:
            log.warning("solver_mode is GPU but no usable GPU (CuPy) was found; running on the CPU")
            return np
        gpu = str(solver_param.device_id)
    if not gpu:
        return np
    what = "--gpu=%s" % gpu
    cp = usable_cupy(what)
    count = cp.cuda.runtime.getDeviceCount()
    ids = parse_gpu_ids(gpu, count)
    device = ids[local_rank % len(ids)] if ids else -1
    check_device_id(what, device, count)
    cp.cuda.Device(device).use()
    log.info("Using GPU %d", device)
    return cp


def signal_effects(flags):
    """{signal: SolverAction} from --sigint_effect, --sighup_effect and
    --sigterm_effect (SIGTERM's "snapshot" also stops: a scheduler kills the
    job next)."""
    from .solvers import SolverAction
    effects = {signal.SIGINT: SolverAction.from_name(flags.sigint_effect)}
    if hasattr(signal, "SIGHUP"):
        effects[signal.SIGHUP] = SolverAction.from_name(flags.sighup_effect)
    effects[signal.SIGTERM] = SolverAction.from_name(flags.sigterm_effect, then_stop=True)
    return effects


class SignalHandler:
    """Caffe's SignalHandler, with SIGTERM beside SIGINT and SIGHUP: a
    signal only sets a flag; the solver polls ``get_action`` after each
    iteration (and test batch), and the ranks agree on the action then.
    ``effects``: {signal number: SolverAction value}."""

    def __init__(self, effects):
        self.effects = effects
        self.pending = []
        self._old = {}
        for sig in effects:
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass

    def _handle(self, signum, frame):
        if signum not in self.pending:
            self.pending.append(signum)

    def get_action(self):
        from .solvers import SolverAction
        if not self.pending:
            return SolverAction.NONE
        return self.effects[self.pending.pop(0)]

    def restore(self):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}


# ---------------------------------------------------------------- commands
def train(flags):
    from .solvers import get_solver, read_solver
    if not flags.solver:
        raise CaffeError("Need a solver definition to train (--solver).")
    if flags.snapshot and flags.weights:
        raise CaffeError("Give a snapshot to resume training or weights to finetune but not both.")
    effects = signal_effects(flags)         # a bad effect fails before anything runs
    param = read_solver(flags.solver)
    param.train_state.level = flags.level
    param.train_state.stage.extend(get_stages(flags))
    # tools/caffe.cpp: the solver's own weights: field is loaded unless
    # --snapshot resumes (the state's net replaces them) or --weights
    # replaces them (caffe.proto: "it has higher priority and overwrites")
    if flags.snapshot or flags.weights:
        del param.weights[:]
    if flags.weights:
        param.weights.append(flags.weights)
    # Under mpirun: MPI, per-rank logging, abort on any rank's error, the
    # gradient strategy.  Without a launcher: one process, no MPI import.
    from .parallel.rank import setup_parallel
    world, sync = setup_parallel(ParallelConfig.from_flags(flags), debug=flags.debug)
    xp = select_backend(flags, param, world)
    tune_allocator()        # a start-up step of the command, not of building a Net
    handler = SignalHandler(effects)
    try:
        solver = get_solver(param, xp=xp, source=flags.solver, sync=sync, memory=flags.memory)
        solver.set_action_function(handler.get_action)
        if flags.snapshot:
            log.info("Resuming from %s", flags.snapshot)
            solver.restore(flags.snapshot)
        log.info("Starting Optimization")
        solver.solve()
    finally:
        handler.restore()
    return 0


def test(flags):
    from .backend import to_numpy
    from .net import Net
    from .solvers.solver import fmt, loss_suffix
    if not flags.model:
        raise CaffeError("Need a model definition to score (--model).")
    if not flags.weights:
        raise CaffeError("Need model weights to score (--weights).")
    xp = select_backend(flags)
    tune_allocator()        # a start-up step of the command, not of building a Net
    if not os.path.exists(flags.model):
        raise CaffeError("model file %s does not exist" % flags.model)
    for w in flags.weights.split(","):
        if w and not os.path.exists(w):
            raise CaffeError("weights file %s does not exist" % w)
    net = Net(flags.model, phase=TEST, level=flags.level, stages=get_stages(flags),
              weights=flags.weights, xp=xp, memory=flags.memory)
    log.info("Running for %d iterations.", flags.iterations)
    scores, names, weights = [], [], []
    loss = 0.0
    for i in range(flags.iterations):
        loss += net.forward_range()
        idx = 0
        for name, vals, w in net.output_values():
            for v in to_numpy(vals).ravel():
                v = float(v)
                if i == 0:
                    scores.append(v)
                    names.append(name)
                    weights.append(w)
                else:
                    scores[idx] += v
                idx += 1
                log.info("Batch %d, %s = %s", i, name, fmt(v))
    n = max(flags.iterations, 1)
    log.info("Loss: %s", fmt(loss / n))
    for s, name, w in zip(scores, names, weights):
        mean = s / n
        log.info("%s = %s%s", name, fmt(mean), loss_suffix(w, mean))
    return 0


def _lazy(module, func):
    def run(flags):
        import importlib
        return getattr(importlib.import_module(module), func)(flags)
    return run


COMMANDS = OrderedDict([
    ("train", train),
    ("test", test),
    ("time", _lazy("caffempi.timing", "time_command")),
    ("device_query", _lazy("caffempi.timing", "device_query_command")),
])


def main(argv=None):
    as_command = argv is None
    if as_command:
        _reexec_for_heap_hugepages()
    argv = list(sys.argv[1:] if as_command else argv)
    debug = any(a.lstrip("-").split("=")[0] == "debug" and a.startswith("-")
                and a.partition("=")[2].lower() not in ("0", "false", "no")
                for a in argv)
    try:
        command, flags = parse_args(argv)
        debug = flags.debug
        answer = FLAGS.answer(flags)
        if answer is not None:
            print(answer)
            return 0
        if command is None:
            raise CaffeError("no command given (train, test, time or device_query; see '%s --help')" % PROG)
        if command not in COMMANDS:
            raise CaffeError("unknown command '%s' (%s)" % (command, ", ".join(COMMANDS)))
        ranks = _ranks_to_launch(command, flags)
        if ranks:
            # the ranks log; this process only waits for them
            from .parallel.launch import run_under_mpiexec
            return run_under_mpiexec(ranks, _command_line(argv, as_command) + FLAGS.without(argv, "ranks"))
        from .parallel.comm import launcher_rank
        configure_logging(PROG, flags, launcher_rank())
        return COMMANDS[command](flags) or 0
    except (CaffeError, ProtoError, OSError) as e:
        if debug:
            raise
        # one line of text: the message may carry MPI's, the OS's or a
        # user file's strings (a library version, a path, a parse error's line)
        msg = printable(" ".join(str(e).split())) or e.__class__.__name__
        if isinstance(e, AgreedError):
            # every rank stopped here together: one line from rank 0, and
            # each rank exits normally (no MPI_Abort)
            if _is_root():
                print("%s: error: %s" % (PROG, msg), file=sys.stderr)
            from .parallel.rank import leave_together
            return leave_together(1)
        print("%s%s: error: %s" % (_rank_prefix(), PROG, msg), file=sys.stderr)
        return _exit_code(1)
    except KeyboardInterrupt:
        if debug:
            raise
        print("%s%s: error: interrupted" % (_rank_prefix(), PROG), file=sys.stderr)
        return _exit_code(1)


def _ranks_to_launch(command, flags):
    """The ranks ``train`` starts under mpiexec (0: none, run here).  test
    and time run on one process (on a --gpu list's first id, as Caffe's)."""
    from .parallel.launch import ranks_to_launch
    if command == "train":
        return ranks_to_launch(flags.ranks, flags.gpu)
    if flags.ranks > 1:
        raise CaffeError("--ranks=%d: '%s' runs on one process (--ranks is for train)" % (flags.ranks, command))
    return 0


def _command_line(argv, as_command):
    """How this program was started, without its arguments, for mpiexec to
    start the ranks the same way: the interpreter, its options and the
    script or ``-m caffempi`` as a command; ``python -m caffempi`` when main
    was called from Python."""
    if not as_command:
        return [sys.executable, "-m", "caffempi"]
    start = sys.orig_argv[:len(sys.orig_argv) - len(argv)]
    return [sys.executable] + start[1:]


def _reexec_for_heap_hugepages():
    """As a command (not when called with argv from Python), restart once
    with glibc's huge-page heap setting, which only works from process start
    (see memory.hugepage_heap_env); under mpirun each rank does it in place
    (exec keeps the pid and the launcher's connection).  The command line
    is the original one, interpreter options (-X, -W, -u ...) included."""
    from .memory import hugepage_heap_env
    env = hugepage_heap_env(os.environ)
    if env is None:
        return
    try:
        os.execve(sys.executable, [sys.executable] + sys.orig_argv[1:], env)
    except OSError:
        pass     # run on without it


def _rank_prefix():
    from .parallel.comm import current_world
    world = current_world()
    return "[rank %d] " % world.rank if world is not None and world.size > 1 else ""


def _is_root():
    from .parallel.comm import current_world
    world = current_world()
    return world is None or world.rank == 0


def _exit_code(rc):
    """Under MPI a failing rank aborts the whole job (MPI_Abort) instead of
    exiting alone, which would leave the other ranks waiting forever."""
    from .parallel.rank import exit_code
    return exit_code(rc)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
