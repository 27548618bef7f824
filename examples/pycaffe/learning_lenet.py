#!/usr/bin/env python
"""BVLC's pycaffe notebooks as one script: 01-learning-lenet (NetSpec writes
LeNet, SGDSolver trains it, test accuracy during training),
00-classification's deploy flow (Transformer, load_image on PNG files,
forward and forward_all), a Python loss layer written against caffe.Layer
that trains a linear regression, and the caffe.io proto helpers.

Written as a pycaffe script: only the two import lines differ.

    python examples/pycaffe/learning_lenet.py TRAIN_LMDB TEST_LMDB WORKDIR [--iters N]
"""
import argparse
import json
import os
import sys

import numpy as np

import caffempi as caffe                          # pycaffe: import caffe
from caffempi import layers as L, params as P     # pycaffe: from caffe import ...


def lenet(lmdb, batch_size):
    """01-learning-lenet's net, as NetSpec writes it."""
    n = caffe.NetSpec()
    n.data, n.label = L.Data(batch_size=batch_size, backend=P.Data.LMDB, source=lmdb,
                             transform_param=dict(scale=1. / 255), ntop=2)
    n.conv1 = L.Convolution(n.data, kernel_size=5, num_output=20, weight_filler=dict(type='xavier'))
    n.pool1 = L.Pooling(n.conv1, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.conv2 = L.Convolution(n.pool1, kernel_size=5, num_output=50, weight_filler=dict(type='xavier'))
    n.pool2 = L.Pooling(n.conv2, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.fc1 = L.InnerProduct(n.pool2, num_output=500, weight_filler=dict(type='xavier'))
    n.relu1 = L.ReLU(n.fc1, in_place=True)
    n.score = L.InnerProduct(n.relu1, num_output=10, weight_filler=dict(type='xavier'))
    n.loss = L.SoftmaxWithLoss(n.score, n.label)
    return n.to_proto()


def deploy_lenet():
    """The same net for deployment: an Input blob and class probabilities."""
    n = caffe.NetSpec()
    n.data = L.Input(shape=dict(dim=[1, 1, 28, 28]))
    n.conv1 = L.Convolution(n.data, kernel_size=5, num_output=20)
    n.pool1 = L.Pooling(n.conv1, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.conv2 = L.Convolution(n.pool1, kernel_size=5, num_output=50)
    n.pool2 = L.Pooling(n.conv2, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.fc1 = L.InnerProduct(n.pool2, num_output=500)
    n.relu1 = L.ReLU(n.fc1, in_place=True)
    n.score = L.InnerProduct(n.relu1, num_output=10)
    n.prob = L.Softmax(n.score)
    return n.to_proto()


def linreg(batch_size):
    """examples/pycaffe/linreg.prototxt's idea: a linear layer and a Python loss
    (Input layers, so that the script feeds a learnable relation)."""
    n = caffe.NetSpec()
    n.data, n.label = L.Input(shape=[dict(dim=[batch_size, 10]), dict(dim=[batch_size, 1])], ntop=2)
    n.ip = L.InnerProduct(n.data, num_output=1, weight_filler=dict(type='xavier'))
    n.loss = L.Python(n.ip, n.label, module='pyloss', layer='EuclideanLossLayer', loss_weight=1)
    return n.to_proto()


def write(path, text):
    with open(path, 'w') as f:
        f.write(str(text))
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("train_lmdb")
    ap.add_argument("test_lmdb")
    ap.add_argument("workdir")
    ap.add_argument("--iters", type=int, default=200)
    a = ap.parse_args(argv)
    os.makedirs(a.workdir, exist_ok=True)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "layers"))           # pyloss, as BVLC's examples do
    caffe.set_mode_cpu()
    results = {}

    # ---- 01-learning-lenet: NetSpec, SGDSolver, test accuracy
    train_proto = write(os.path.join(a.workdir, 'lenet_auto_train.prototxt'), lenet(a.train_lmdb, 64))
    test_proto = write(os.path.join(a.workdir, 'lenet_auto_test.prototxt'), lenet(a.test_lmdb, 100))
    solver_proto = write(os.path.join(a.workdir, 'lenet_auto_solver.prototxt'), "\n".join([
        'train_net: "%s"' % train_proto, 'test_net: "%s"' % test_proto,
        'test_iter: 10', 'test_interval: 100000', 'base_lr: 0.01', 'momentum: 0.9',
        'weight_decay: 0.0005', 'lr_policy: "inv"', 'gamma: 0.0001', 'power: 0.75',
        'display: 0', 'max_iter: %d' % a.iters, 'snapshot: 0',
        'snapshot_prefix: "%s"' % os.path.join(a.workdir, 'lenet')]))
    solver = caffe.SGDSolver(solver_proto)
    print("blobs:", [(k, v.data.shape) for k, v in solver.net.blobs.items()])
    print("params:", [(k, v[0].data.shape) for k, v in solver.net.params.items()])
    solver.net.forward()
    solver.test_nets[0].forward()
    train_loss = np.zeros(a.iters)
    for it in range(a.iters):
        solver.step(1)
        train_loss[it] = solver.net.blobs['loss'].data
    correct = 0
    for _ in range(10):
        solver.test_nets[0].forward()
        correct += (solver.test_nets[0].blobs['score'].data.argmax(1)
                    == solver.test_nets[0].blobs['label'].data).sum()
    results['first_loss'] = float(train_loss[:10].mean())
    results['last_loss'] = float(train_loss[-10:].mean())
    results['test_accuracy'] = correct / 1000.
    print("train loss %.3f -> %.3f, test accuracy %.3f" % (
        results['first_loss'], results['last_loss'], results['test_accuracy']))
    weights = os.path.join(a.workdir, 'lenet.caffemodel')
    solver.net.save(weights)

    # ---- 00-classification: the deploy flow on PNG files
    from PIL import Image
    test_net = solver.test_nets[0]
    images = test_net.blobs['data'].data[:20] * 255.        # what the Data layer read, back to pixels
    labels = test_net.blobs['label'].data[:20].astype(int)
    pngs = []
    for i, im in enumerate(images):
        pngs.append(os.path.join(a.workdir, 'digit%02d.png' % i))
        Image.fromarray(np.round(im[0]).astype(np.uint8)).save(pngs[-1])
    deploy = write(os.path.join(a.workdir, 'lenet_deploy.prototxt'), deploy_lenet())
    net = caffe.Net(deploy, weights, caffe.TEST)
    transformer = caffe.io.Transformer({'data': net.blobs['data'].data.shape})
    transformer.set_transpose('data', (2, 0, 1))              # H x W x K -> K x H x W
    net.blobs['data'].reshape(len(pngs), 1, 28, 28)
    for i, png in enumerate(pngs):
        image = caffe.io.load_image(png, color=False)          # H x W x 1 in [0, 1]
        net.blobs['data'].data[i] = transformer.preprocess('data', image)
    prob = net.forward()['prob']
    results['deploy_accuracy'] = float((prob.argmax(1) == labels).mean())
    all_prob = net.forward_all(data=images[:7] / 255.)['prob']  # 7 images, any batch size
    results['forward_all_matches'] = bool(np.allclose(all_prob, prob[:7], atol=1e-5))
    print("deploy accuracy on %d PNG files %.3f; forward_all agrees: %s" % (
        len(pngs), results['deploy_accuracy'], results['forward_all_matches']))

    # ---- a Python loss layer that trains
    reg_proto = write(os.path.join(a.workdir, 'linreg.prototxt'), linreg(32))
    reg_solver = write(os.path.join(a.workdir, 'linreg_solver.prototxt'), "\n".join([
        'train_net: "%s"' % reg_proto, 'base_lr: 0.1', 'lr_policy: "fixed"', 'momentum: 0.9',
        'display: 0', 'max_iter: 100', 'snapshot: 0', 'snapshot_prefix: "%s"' % a.workdir]))
    reg = caffe.SGDSolver(reg_solver)
    rng = np.random.RandomState(0)
    w_true = rng.randn(10).astype(np.float32)
    losses = []
    for _ in range(100):
        x = rng.randn(32, 10).astype(np.float32)
        reg.net.blobs['data'].data[...] = x
        reg.net.blobs['label'].data[...] = (x @ w_true)[:, None]
        reg.step(1)
        losses.append(reg.net.blobs['loss'].data.item())
    results['python_loss_first'] = losses[0]
    results['python_loss_last'] = losses[-1]
    results['python_layer_weight_error'] = float(np.abs(reg.net.params['ip'][0].data[0] - w_true).max())
    print("Python Euclidean loss %.4f -> %.6f" % (losses[0], losses[-1]))

    # ---- caffe.io's proto helpers
    mean = test_net.blobs['data'].data.mean(0)                 # 1 x 28 x 28
    blob = caffe.io.array_to_blobproto(mean[None])
    round_trip = caffe.io.blobproto_to_array(
        caffe.proto.caffe_pb2.BlobProto.FromString(blob.SerializeToString()))
    datum = caffe.io.array_to_datum(np.round(images[0]).astype(np.uint8), int(labels[0]))
    pixels = caffe.io.datum_to_array(caffe.proto.caffe_pb2.Datum.FromString(datum.SerializeToString()))
    results['io_round_trip'] = bool(np.array_equal(round_trip[0], mean)
                                    and np.array_equal(pixels, np.round(images[0]).astype(np.uint8)))
    print("caffe.io round trips: %s" % results['io_round_trip'])
    with open(os.path.join(a.workdir, 'results.json'), 'w') as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
