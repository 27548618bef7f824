"""upgrade_net_proto_text, upgrade_net_proto_binary, upgrade_solver_proto_text:
an old Caffe definition rewritten in the current format, as BVLC's
tools/upgrade_*.cpp do.  Nets: V1 ``layers`` become ``layer``, the data
layers' transformation fields move to ``transform_param``, net-level
``input``/``input_dim``/``input_shape`` become an Input layer, old BatchNorm
param specs are dropped; a binary .caffemodel keeps its weights.  Solvers: the
``solver_type`` enum becomes the ``type`` string.  (caffempi reads the old
formats anyway; these tools are for files other programs read.)

    python tools/upgrade_net_proto_text.py OLD.prototxt NEW.prototxt
    python tools/upgrade_net_proto_binary.py OLD.caffemodel NEW.caffemodel
    python tools/upgrade_solver_proto_text.py OLD_solver.prototxt NEW_solver.prototxt
"""
from ..flags import FlagSet
from ..io import proto_io
from ..proto import caffe_pb2
from ._util import info, run_tool

# tool -> (message, binary file, upgrade function, what the log calls it)
TOOLS = {
    "upgrade_net_proto_text": (caffe_pb2.NetParameter, False, proto_io.upgrade_net_param,
                               "NetParameter text"),
    "upgrade_net_proto_binary": (caffe_pb2.NetParameter, True, proto_io.upgrade_net_param,
                                 "NetParameter binary"),
    "upgrade_solver_proto_text": (caffe_pb2.SolverParameter, False, proto_io.upgrade_solver_param,
                                  "SolverParameter text"),
}


def upgrade_file(tool, src, dst):
    """Read ``src``, upgrade, write ``dst`` atomically; returns whether
    anything changed."""
    msg_cls, binary, upgrade, what = TOOLS[tool]
    msg = proto_io.read_binary_proto(src, msg_cls) if binary else \
        proto_io.read_text_proto(src, msg_cls, what.split()[0])
    before = msg_cls()
    before.CopyFrom(msg)
    upgrade(msg, src)
    changed = msg != before
    if not changed:
        info("File already in latest proto format: %s", src)
    (proto_io.write_binary_proto_atomic if binary else proto_io.write_text_proto_atomic)(dst, msg)
    info("Wrote upgraded %s proto to %s", what, dst)
    return changed


def _runner(tool):
    flags = FlagSet(tool, "Upgrade a %s proto file to the current format" % TOOLS[tool][3])
    flags.argument("INPUT", "the old file")
    flags.argument("OUTPUT", "the upgraded file to write")

    def body(_flags, src, dst):
        upgrade_file(tool, src, dst)

    def main(argv=None):
        return run_tool(flags, body, argv)
    main.__name__ = tool
    return main


upgrade_net_proto_text = _runner("upgrade_net_proto_text")
upgrade_net_proto_binary = _runner("upgrade_net_proto_binary")
upgrade_solver_proto_text = _runner("upgrade_solver_proto_text")
