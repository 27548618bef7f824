"""draw_net: draw a net prototxt as a graph (pycaffe's python/draw_net.py).

    python tools/draw_net.py [--rankdir=LR] [--phase=ALL] [--display_lrm] NET_PROTOTXT OUTPUT_FILE

The output format is the file's extension: .dot / .raw write the Graphviz
source (no Graphviz needed); .png, .svg, .pdf, ... need Graphviz's ``dot``.
The prototxt is read with Caffe's upgrades, so V1 nets draw as well.
"""
from .. import draw
from ..common import TEST, TRAIN, CaffeError
from ..flags import FlagSet
from ..io import proto_io
from ._util import info, run_tool

PHASES = {"TRAIN": TRAIN, "TEST": TEST, "ALL": None}

FLAGS = FlagSet("draw_net", "Draw a graph of the net architecture.")
FLAGS.argument("input_net_proto_file", "Input network prototxt file")
FLAGS.argument("output_image_file", "Output image file; its extension is the format (.dot/.raw: Graphviz source)")
FLAGS.define("rankdir", "LR", "One of TB (top-bottom, i.e., vertical), RL (right-left, i.e., horizontal), "
             "or another valid dot option (LR, BT)")
FLAGS.define("phase", "ALL", "Which network phase to draw: TRAIN, TEST, or ALL (all layers regardless of phase)")
FLAGS.define("display_lrm", False, "Show the learning rate multipliers, when non-zero, of the learning layers "
             "(Convolution, Deconvolution, InnerProduct)")


def _run(flags, input_net_proto_file, output_image_file):
    if flags.phase not in PHASES:
        raise CaffeError("unknown --phase '%s' (TRAIN, TEST or ALL)" % flags.phase)
    net = proto_io.read_net_param(input_net_proto_file)
    info("Drawing net to %s", output_image_file)
    draw.draw_net_to_file(net, output_image_file, flags.rankdir, PHASES[flags.phase], flags.display_lrm)


def main(argv=None):
    return run_tool(FLAGS, _run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
