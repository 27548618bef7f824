"""pycaffe's ``caffe.draw``: a NetParameter as a Graphviz graph through pydot.

One node per layer (labelled with its name, type and, for Convolution /
Deconvolution / Pooling, kernel, stride and pad), one octagon per blob, and
edges bottom blob -> layer -> top blob.  pydot is an optional extra
(``pip install caffempi[draw]``).  ``.dot``/``.raw`` files are the graph's
DOT source and need no Graphviz; other formats (png, svg, pdf, ...) are
rendered by Graphviz's ``dot`` program, which must be on PATH.
"""
import shutil

from .common import CaffeError
from .proto import caffe_pb2

__all__ = ["get_pooling_types_dict", "get_edge_label", "get_layer_lr_mult", "get_layer_label",
           "choose_color_by_layertype", "get_pydot_graph", "draw_net", "draw_net_to_file"]

LAYER_STYLE_DEFAULT = {"shape": "record", "fillcolor": "#6495ED", "style": "filled"}
NEURON_LAYER_STYLE = {"shape": "record", "fillcolor": "#90EE90", "style": "filled"}
BLOB_STYLE = {"shape": "octagon", "fillcolor": "#E0E0E0", "style": "filled"}

# formats written from the DOT source without running Graphviz
SOURCE_FORMATS = ("dot", "raw")
LEARNING_LAYERS = ("Convolution", "Deconvolution", "InnerProduct")


def _pydot():
    try:
        import pydot
    except ImportError:
        raise CaffeError("drawing a net needs pydot: pip install caffempi[draw]") from None
    return pydot


def get_pooling_types_dict():
    """{PoolingParameter.PoolMethod number: name}."""
    return {v.number: name for name, v in caffe_pb2.PoolingParameter.PoolMethod.DESCRIPTOR.values_by_name.items()}


def get_edge_label(layer):
    """Label of a layer's top edges: batch size for Data, num_output for
    Convolution / Deconvolution / InnerProduct, else empty ('""')."""
    if layer.type == "Data":
        return "Batch %d" % layer.data_param.batch_size
    if layer.type in ("Convolution", "Deconvolution"):
        return str(layer.convolution_param.num_output)
    if layer.type == "InnerProduct":
        return str(layer.inner_product_param.num_output)
    return '""'


def get_layer_lr_mult(layer):
    """(weights, bias) lr_mult of a Convolution / Deconvolution / InnerProduct layer."""
    if layer.type not in LEARNING_LAYERS:
        raise CaffeError("layer '%s': %s layers do not have a learning rate multiplier" % (layer.name, layer.type))
    if len(layer.param) > 2:
        raise CaffeError("layer '%s': %d param specs, expected at most 2 (weights, bias)"
                         % (layer.name, len(layer.param)))
    mults = [p.lr_mult for p in layer.param] + [1.0, 1.0]
    return mults[0], mults[1]


def get_layer_label(layer, rankdir, display_lrm=False):
    """A layer node's label, double-quoted for DOT: name, (type), the spatial
    parameters of Convolution / Deconvolution / Pooling and, with
    ``display_lrm``, non-zero lr_mults; words joined by spaces for a
    vertical layout (rankdir TB/BT), by line breaks otherwise."""
    separator = " " if rankdir in ("TB", "BT") else r"\n"
    parts = [layer.name]
    if layer.type == "Pooling":
        parts.append("(Pooling %s)" % get_pooling_types_dict()[layer.pooling_param.pool])
    else:
        parts.append("(%s)" % layer.type)
    if layer.type == "Pooling":
        p = layer.pooling_param
        spatial = (p.kernel_size, p.stride, p.pad)
    elif layer.type in ("Convolution", "Deconvolution"):
        p = layer.convolution_param
        spatial = (p.kernel_size[0] if len(p.kernel_size) else 1, p.stride[0] if len(p.stride) else 1,
                   p.pad[0] if len(p.pad) else 0)
    else:
        spatial = None
    if spatial is not None:
        parts.append(separator.join(["kernel size: %d" % spatial[0], "stride: %d" % spatial[1],
                                     "pad: %d" % spatial[2]]))
    if display_lrm and layer.type in LEARNING_LAYERS:
        weights_mult, bias_mult = get_layer_lr_mult(layer)
        if weights_mult or bias_mult:
            parts.append("lr mult: %.1f, %.1f" % (weights_mult, bias_mult))
    return '"%s"' % separator.join(parts)


def choose_color_by_layertype(layertype):
    """Fill colour of a layer node by its type."""
    return {"Convolution": "#FF5050", "Deconvolution": "#FF5050", "Pooling": "#FF9900",
            "InnerProduct": "#CC33FF"}.get(layertype, "#6495ED")


def _in_phase(layer, phase):
    """pycaffe's phase filter: include rules name phases the layer is in,
    exclude rules phases it is not (stages and levels are not considered)."""
    if phase is None:
        return True
    if len(layer.include) and len(layer.exclude):
        raise CaffeError("layer '%s' has both include and exclude specified" % layer.name)
    if len(layer.include):
        return any(rule.phase == phase for rule in layer.include)
    return not any(rule.phase == phase for rule in layer.exclude)


def get_pydot_graph(caffe_net, rankdir, label_edges=True, phase=None, display_lrm=False):
    """pydot.Dot of the NetParameter ``caffe_net``: the layers of ``phase``
    (caffe.TRAIN / caffe.TEST; None: all layers), laid out in ``rankdir``."""
    pydot = _pydot()
    graph = pydot.Dot(caffe_net.name or "Net", graph_type="digraph", rankdir=rankdir)
    nodes, edges = {}, []
    for layer in caffe_net.layer:
        if not _in_phase(layer, phase):
            continue
        label = get_layer_label(layer, rankdir, display_lrm=display_lrm)
        layer_node = "%s_%s" % (layer.name, layer.type)
        if len(layer.bottom) == 1 and list(layer.bottom) == list(layer.top):     # in-place neuron layer
            style = NEURON_LAYER_STYLE
        else:
            style = dict(LAYER_STYLE_DEFAULT, fillcolor=choose_color_by_layertype(layer.type))
        nodes[layer_node] = pydot.Node(layer_node, label=label, **style)
        for bottom in layer.bottom:
            nodes[bottom + "_blob"] = pydot.Node(bottom + "_blob", label='"%s"' % bottom, **BLOB_STYLE)
            edges.append((bottom + "_blob", layer_node, '""'))
        top_label = get_edge_label(layer) if label_edges else '""'
        for top in layer.top:
            nodes[top + "_blob"] = pydot.Node(top + "_blob", label='"%s"' % top, **BLOB_STYLE)
            edges.append((layer_node, top + "_blob", top_label))
    for node in nodes.values():
        graph.add_node(node)
    for src, dst, label in edges:
        graph.add_edge(pydot.Edge(nodes[src], nodes[dst], label=label))
    return graph


def draw_net(caffe_net, rankdir, ext="png", phase=None, display_lrm=False):
    """The drawing of ``caffe_net`` as bytes in format ``ext`` ('dot'/'raw':
    the DOT source; others rendered by Graphviz's ``dot``)."""
    graph = get_pydot_graph(caffe_net, rankdir, phase=phase, display_lrm=display_lrm)
    if ext in SOURCE_FORMATS:
        return graph.to_string().encode("utf-8")
    if shutil.which("dot") is None:
        raise CaffeError("drawing a net as .%s needs Graphviz's 'dot' program on PATH "
                         "(install graphviz), or write .dot / .raw" % ext)
    try:
        return graph.create(format=ext)
    except Exception as e:  # pydot raises AssertionError / OSError with Graphviz's stderr
        raise CaffeError("Graphviz could not draw the net as .%s: %s" % (ext, " ".join(str(e).split()))) from None


def draw_net_to_file(caffe_net, filename, rankdir="LR", phase=None, display_lrm=False):
    """Draw ``caffe_net`` into ``filename`` in the format its extension names
    (.dot / .raw write the DOT source for Graphviz)."""
    filename = str(filename)
    ext = filename[filename.rfind(".") + 1:]
    data = draw_net(caffe_net, rankdir, ext, phase, display_lrm)
    try:
        with open(filename, "wb") as f:
            f.write(data)
    except OSError as e:
        raise CaffeError("cannot write %s: %s" % (filename, e.strerror or e)) from None
