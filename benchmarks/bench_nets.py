"""The nets that the speed benchmarks train (net_speed.py on the CPU,
gpu_speed.py on a GPU), as trainable NetParameters with their data layers
replaced: LeNet and CIFAR10-quick from models/, CaffeNet and AlexNet from
BVLC's train_val prototxts (GoogLeNet's with its two auxiliary losses) and
ResNet-50 from its deploy prototxt in
../shared/caffe-zoo (plus labels and a SoftmaxWithLoss)."""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
ZOO = REPO.parent / "shared" / "caffe-zoo"

# key: (name, prototxt: models/... or relative to the zoo, image shape, default batch)
NETS = {
    "lenet": ("LeNet", "models/mnist/lenet_train_test.prototxt", (1, 28, 28), 64),
    "cifar": ("CIFAR10-quick", "models/cifar10/cifar10_quick_train_test.prototxt", (3, 32, 32), 100),
    "caffenet": ("CaffeNet", "bvlc/models/bvlc_reference_caffenet/train_val.prototxt", (3, 227, 227), 8),
    "alexnet": ("AlexNet", "bvlc/models/bvlc_alexnet/train_val.prototxt", (3, 227, 227), 256),
    "resnet50": ("ResNet-50", "resnet/ResNet-50-deploy.prototxt", (3, 224, 224), 32),
    "googlenet": ("GoogLeNet", "bvlc/models/bvlc_googlenet/train_val.prototxt", (3, 224, 224), 32),
}


def split_key(key):
    """(table key, batch or None) of ``key`` or ``key:batch``."""
    base, _, batch = key.partition(":")
    return base, int(batch) if batch else None


def net_param(key, zoo=ZOO, batch=None):
    """(NetParameter, batch) to train ``key`` (``key:batch`` names the
    batch) at ``batch`` (default: the key's, else the table's): data layers
    replaced by Input layers of the batch's shape; a deploy net gets a
    label input and a loss, msra fillers where it names none, and batch
    statistics in its BatchNorm layers."""
    from caffempi.io import proto_io
    from caffempi.proto import caffe_pb2
    from caffempi.timing import substitute_data_layers
    key, keyed = split_key(key)
    _, path, shape, default_batch = NETS[key]
    batch = batch or keyed or default_batch
    full = REPO / path if path.startswith("models/") else Path(zoo) / path
    param = proto_io.read_net_param(str(full))
    param = substitute_data_layers(param, shape, only_unreadable=False, warn=False, batch_size=batch)
    if not any(lp.type.endswith("Loss") for lp in param.layer):
        # deploy form: the input comes from input/input_shape (upgraded to an
        # Input layer on read); set its batch, add labels and a loss
        layers = list(param.layer)
        layers[0].input_param.shape[0].dim[0] = batch
        labels = caffe_pb2.LayerParameter(name="label", type="Input", top=["label"])
        labels.input_param.shape.add().dim.append(batch)
        if layers[-1].type == "Softmax":       # train on the logits
            layers.pop()
        loss = caffe_pb2.LayerParameter(name="loss", type="SoftmaxWithLoss",
                                        bottom=[layers[-1].top[0], "label"], top=["loss"])
        del param.layer[:]
        param.layer.extend([layers[0], labels] + layers[1:] + [loss])
        for lp in param.layer:
            # deploy nets name no fillers (Caffe's default is 0) and normalise
            # with stored statistics: train with msra weights and batch statistics
            for p in (lp.convolution_param, lp.inner_product_param):
                if lp.type in ("Convolution", "InnerProduct") and not p.HasField("weight_filler"):
                    p.weight_filler.type = "msra"
            if lp.type == "BatchNorm":
                lp.batch_norm_param.use_global_stats = False
    return param, batch


def random_inputs(net, seed=0):
    """Gaussian images and labels in range, as host arrays by top name."""
    import numpy as np
    rs = np.random.RandomState(seed)
    out = {}
    classes = None
    for layer in net.layers:
        if layer.type in ("InnerProduct", "Convolution") and getattr(layer, "num_output", None):
            classes = layer.num_output          # the last one is the classifier
    for layer, tops in zip(net.layers, net.top_vecs):
        if layer.type != "Input":
            continue
        for name, top in zip(layer.param.top, tops):
            if len(top.shape) == 1:
                out[name] = rs.randint(0, classes or 2, top.shape).astype(np.float32)
            else:
                out[name] = rs.standard_normal(top.shape).astype(np.float32)
    return out


def with_dummy_data(param):
    """``param`` with its Input layers made DummyData layers of the same
    shapes, as Caffe's ``caffe time`` needs: images drawn N(0, 1) every
    forward, labels constant 0."""
    from caffempi.proto import caffe_pb2
    out = caffe_pb2.NetParameter()
    out.CopyFrom(param)
    for lp in out.layer:
        if lp.type != "Input":
            continue
        shapes = list(lp.input_param.shape)
        lp.type = "DummyData"
        lp.ClearField("input_param")
        for shape in shapes:
            lp.dummy_data_param.shape.add().CopyFrom(shape)
            f = lp.dummy_data_param.data_filler.add()
            if len(shape.dim) > 1:
                f.type, f.std = "gaussian", 1.0
            else:
                f.type, f.value = "constant", 0.0
    return out
