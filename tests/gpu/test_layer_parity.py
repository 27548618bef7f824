"""Every layer type on CuPy against NumPy: forward tops, bottom and parameter
gradients within float32 tolerance, same seeded parameters and inputs."""
import numpy as np
import pytest

from caffempi.common import TEST
from caffempi.layer_types.base import LAYER_REGISTRY
from caffempi.testing.parity import check_backend_parity

pytestmark = pytest.mark.gpu

# data-reading layers fill host batches; the training parity test covers Data
# (HDF5Output writes host copies of its bottoms: tests/layers/test_data_more.py)
FILE_DATA = {"Data", "ImageData", "HDF5Data", "MemoryData", "WindowData", "HDF5Output"}
# a Python layer computes with the user's module, not ours
# (tests/layers/test_python_layer.py runs it)
USER_CODE = {"Python"}


def rand(*shape, seed=0):
    return np.random.RandomState(seed).randn(*shape)


def distinct(*shape, seed=0):
    """Values with no ties (MAX pooling, ArgMax, Eltwise MAX pick one)."""
    return np.random.RandomState(seed).permutation(int(np.prod(shape))).reshape(shape) / 7.0 - 3.0


def labels(n, classes, seed=0):
    return np.random.RandomState(seed).randint(0, classes, n).astype(float)


CONV = 'type: "%s" convolution_param { %s weight_filler { type: "gaussian" std: 0.1 } bias_filler { type: "gaussian" std: 0.1 } }'
POOL = 'type: "Pooling" pooling_param { %s }'
RECURRENT = ('type: "%s" recurrent_param { num_output: 4 expose_hidden: %s '
             'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" std: 0.5 } }')

# (layer text, bottoms, options)
CASES = {
    "AbsVal": [('type: "AbsVal"', [rand(2, 3, 4, 5)], {})],
    "Accuracy": [('type: "Accuracy" accuracy_param { top_k: 2 }', [rand(6, 5), labels(6, 5)],
                  {"check_bottoms": []})],
    "ArgMax": [('type: "ArgMax" argmax_param { top_k: 2 out_max_val: true }', [distinct(3, 6)],
                {"check_bottoms": []})],
    "BNLL": [('type: "BNLL"', [rand(2, 3, 4)], {})],
    "BatchNorm": [('type: "BatchNorm"', [rand(4, 3, 5, 5)], {}),
                  ('type: "BatchNorm" batch_norm_param { use_global_stats: false eps: 0.001 }',
                   [rand(3, 4, 2, 2)], {}),
                  ('type: "BatchNorm" batch_norm_param { scale_bias: true '
                   'scale_filler { type: "gaussian" } bias_filler { type: "gaussian" } }',
                   [rand(4, 3, 5, 5)], {})],
    "BatchReindex": [('type: "BatchReindex"', [rand(4, 3, 2), np.array([2, 0, 2, 3.])],
                      {"check_bottoms": [0]})],
    "Bias": [('type: "Bias" bias_param { filler { type: "gaussian" } }', [rand(2, 3, 4, 4)], {}),
             ('type: "Bias" bias_param { axis: 1 }', [rand(2, 3, 4, 4), rand(3, 4, seed=1)], {})],
    "Clip": [('type: "Clip" clip_param { min: -0.5 max: 0.7 }', [rand(2, 3, 4)], {})],
    "Concat": [('type: "Concat"', [rand(2, 3, 4), rand(2, 5, 4, seed=1)], {}),
               ('type: "Concat" concat_param { axis: 2 }', [rand(2, 3, 4), rand(2, 3, 2, seed=1)], {})],
    "ContrastiveLoss": [('type: "ContrastiveLoss" contrastive_loss_param { margin: 2 }',
                         [rand(6, 4), rand(6, 4, seed=1), labels(6, 2)], {"check_bottoms": [0, 1]})],
    "Convolution": [
        (CONV % ("Convolution", "num_output: 6 kernel_size: 3 pad: 1"), [rand(3, 4, 9, 8)], {}),
        (CONV % ("Convolution", "num_output: 6 kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1 "
                 "pad_h: 1 pad_w: 0 group: 2"), [rand(2, 4, 9, 7)], {}),
        (CONV % ("Convolution", "num_output: 4 kernel_size: 3 dilation: 2 pad: 2 bias_term: false"),
         [rand(2, 3, 10, 10)], {}),
        (CONV % ("Convolution", "num_output: 8 kernel_size: 1"), [rand(2, 6, 5, 5)], {}),
        (CONV % ("Convolution", "num_output: 8 kernel_size: 1 stride: 2 group: 2"), [rand(2, 6, 7, 7)], {}),
        (CONV % ("Convolution", "num_output: 16 kernel_size: 11 stride: 4"), [rand(2, 3, 35, 35)], {}),
    ],
    "Crop": [('type: "Crop" crop_param { axis: 1 offset: 1 offset: 2 offset: 0 }',
              [rand(2, 4, 5, 4), rand(2, 2, 3, 2)], {"check_bottoms": [0]})],
    "Deconvolution": [(CONV % ("Deconvolution", "num_output: 5 kernel_size: 4 stride: 2 pad: 1"),
                       [rand(2, 4, 5, 5)], {}),
                      (CONV % ("Deconvolution", "num_output: 4 kernel_size: 3 group: 2"),
                       [rand(2, 4, 3, 3)], {})],
    # TRAIN draws its mask on the device (test_dropout_train_on_gpu)
    "Dropout": [('type: "Dropout"', [rand(4, 50)], {"phase": TEST})],
    "DummyData": [('type: "DummyData" dummy_data_param { shape { dim: 2 dim: 3 } '
                   'data_filler { type: "constant" value: 1.5 } }', [], {"num_top": 1})],
    "ELU": [('type: "ELU" elu_param { alpha: 0.7 }', [rand(2, 3, 4)], {})],
    "Eltwise": [('type: "Eltwise" eltwise_param { operation: SUM coeff: 1.5 coeff: -0.5 }',
                 [rand(2, 3, 4), rand(2, 3, 4, seed=1)], {}),
                ('type: "Eltwise" eltwise_param { operation: PROD }',
                 [rand(2, 3, 4), rand(2, 3, 4, seed=1), rand(2, 3, 4, seed=2)], {}),
                ('type: "Eltwise" eltwise_param { operation: MAX }',
                 [distinct(2, 3, 4), distinct(2, 3, 4, seed=1)], {})],
    "Embed": [('type: "Embed" embed_param { num_output: 3 input_dim: 5 '
               'weight_filler { type: "gaussian" } bias_filler { type: "gaussian" } }',
               [np.array([[0, 4, 2, 2], [2, 1, 1, 0]], float)], {"check_bottoms": []})],
    "EuclideanLoss": [('type: "EuclideanLoss"', [rand(4, 5), rand(4, 5, seed=1)], {})],
    "Exp": [('type: "Exp" exp_param { base: 2 scale: 0.5 shift: 0.1 }', [rand(2, 3, 4)], {})],
    "Filter": [('type: "Filter"', [rand(5, 3), rand(5, 2, seed=1), np.array([1, 0, 1, 1, 0.])],
                {"check_bottoms": [0, 1], "num_top": 2})],
    "Flatten": [('type: "Flatten"', [rand(2, 3, 4, 5)], {})],
    "HingeLoss": [('type: "HingeLoss" hinge_loss_param { norm: L2 }', [rand(5, 4), labels(5, 4)],
                   {"check_bottoms": [0]})],
    "Im2col": [('type: "Im2col" convolution_param { kernel_size: 3 pad: 1 stride: 2 }', [rand(2, 3, 7, 6)], {}),
               ('type: "Im2col" convolution_param { kernel_h: 2 kernel_w: 3 dilation: 2 }',
                [rand(2, 2, 6, 7)], {})],
    "InfogainLoss": [('type: "InfogainLoss"', [rand(4, 3), labels(4, 3),
                                                 np.abs(rand(3, 3, seed=2)) + np.eye(3)],
                      {"check_bottoms": [0]})],
    "InnerProduct": [('type: "InnerProduct" inner_product_param { num_output: 7 '
                      'weight_filler { type: "gaussian" } bias_filler { type: "gaussian" } }',
                      [rand(4, 3, 2, 2)], {}),
                     ('type: "InnerProduct" inner_product_param { num_output: 5 transpose: true axis: 2 '
                      'weight_filler { type: "gaussian" } }', [rand(2, 3, 6)], {})],
    "Input": [('type: "Input" input_param { shape { dim: 2 dim: 3 } }', [], {"num_top": 1})],
    "LRN": [('type: "LRN" lrn_param { local_size: 5 alpha: 0.0001 beta: 0.75 }', [rand(2, 7, 6, 6)], {}),
            ('type: "LRN" lrn_param { local_size: 3 alpha: 2 beta: 0.6 k: 2 }', [rand(2, 4, 3, 3)], {}),
            ('type: "LRN" lrn_param { local_size: 5 alpha: 1.5 beta: 0.75 }', [rand(2, 9, 4, 5)], {}),
            ('type: "LRN" lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 norm_region: WITHIN_CHANNEL }',
             [rand(2, 3, 5, 6)], {})],
    "LSTM": [(RECURRENT % ("LSTM", "false"), [rand(3, 2, 5), np.array([[0, 0], [1, 1], [1, 0.]])],
              {"check_bottoms": [0]}),
             (RECURRENT % ("LSTM", "true"), [rand(3, 2, 5), np.array([[1, 0], [1, 1], [0, 1.]]), rand(2, 3, seed=1),
                                             rand(1, 2, 4, seed=2), rand(1, 2, 4, seed=3)],
              {"check_bottoms": [0, 2, 3, 4], "num_top": 3})],
    "LSTMUnit": [('type: "LSTMUnit"', [rand(1, 3, 4), rand(1, 3, 16, seed=1), np.array([[1, 0, 1.]])],
                  {"check_bottoms": [0, 1], "num_top": 2})],
    "Log": [('type: "Log" log_param { base: 3 scale: 0.5 shift: 4 }', [rand(2, 3, 4)], {})],
    "MVN": [('type: "MVN"', [rand(2, 3, 4, 4)], {}),
            ('type: "MVN" mvn_param { across_channels: true normalize_variance: false }',
             [rand(2, 3, 4, 4)], {})],
    "MultinomialLogisticLoss": [('type: "MultinomialLogisticLoss"',
                                 [np.random.RandomState(3).uniform(0.1, 1, (4, 5)), labels(4, 5)],
                                 {"check_bottoms": [0]})],
    "PReLU": [('type: "PReLU"', [rand(2, 3, 4, 4)], {}),
              ('type: "PReLU" prelu_param { channel_shared: true }', [rand(2, 3, 4, 4)], {})],
    "Parameter": [('type: "Parameter" parameter_param { shape { dim: 2 dim: 3 } }', [], {"num_top": 1})],
    "Pooling": [
        (POOL % "pool: MAX kernel_size: 3 stride: 2", [distinct(2, 3, 9, 8)], {}),
        (POOL % "pool: MAX kernel_size: 2 stride: 2", [distinct(2, 3, 8, 8)], {}),
        (POOL % "pool: MAX kernel_size: 3 stride: 2 pad: 1", [distinct(2, 3, 7, 6)], {}),
        (POOL % "pool: AVE kernel_size: 3 stride: 2", [rand(2, 3, 9, 8)], {}),
        (POOL % "pool: AVE kernel_size: 3 stride: 2 pad: 1", [rand(2, 3, 16, 16)], {}),
        (POOL % "pool: AVE kernel_size: 7 stride: 1", [rand(2, 3, 7, 7)], {}),
        (POOL % "pool: MAX global_pooling: true", [distinct(2, 3, 5, 4)], {}),
        (POOL % "pool: AVE global_pooling: true", [rand(2, 3, 5, 4)], {}),
    ],
    "Power": [('type: "Power" power_param { power: 2 scale: 0.5 shift: 3 }', [rand(2, 3, 4)], {})],
    "RNN": [(RECURRENT % ("RNN", "true"), [rand(3, 2, 5), np.array([[1, 0], [1, 1], [0, 1.]]), rand(1, 2, 4, seed=2)],
             {"check_bottoms": [0, 2], "num_top": 2})],
    "ReLU": [('type: "ReLU"', [rand(2, 3, 4)], {}),
             ('type: "ReLU" relu_param { negative_slope: 0.1 }', [rand(2, 3, 4)], {})],
    "Reduction": [('type: "Reduction" reduction_param { operation: %s axis: 1 coeff: -2 }' % op,
                   [distinct(2, 3, 4)], {}) for op in ("SUM", "ASUM", "SUMSQ", "MEAN")],
    "Reshape": [('type: "Reshape" reshape_param { shape { dim: 0 dim: -1 } }', [rand(2, 3, 4)], {})],
    "SPP": [('type: "SPP" spp_param { pyramid_height: 3 pool: MAX }', [distinct(2, 3, 9, 8)], {}),
            ('type: "SPP" spp_param { pyramid_height: 2 pool: AVE }', [rand(2, 3, 7, 6)], {})],
    "Scale": [('type: "Scale" scale_param { bias_term: true filler { type: "gaussian" } '
               'bias_filler { type: "gaussian" } }', [rand(2, 3, 4, 4)], {}),
              ('type: "Scale" scale_param { axis: 0 }', [rand(2, 3, 4, 4), rand(2, 3, seed=1)], {})],
    "Sigmoid": [('type: "Sigmoid"', [rand(2, 3, 4)], {})],
    "SigmoidCrossEntropyLoss": [('type: "SigmoidCrossEntropyLoss"',
                                 [rand(4, 5), (rand(4, 5, seed=1) > 0).astype(float)],
                                 {"check_bottoms": [0]})],
    "Silence": [('type: "Silence"', [rand(2, 3), rand(4, seed=1)], {"num_top": 0})],
    "Slice": [('type: "Slice" slice_param { axis: 1 slice_point: 1 slice_point: 4 }',
               [rand(2, 6, 3)], {"num_top": 3})],
    "Softmax": [('type: "Softmax"', [rand(3, 5, 2)], {}),
                ('type: "Softmax" softmax_param { axis: 2 }', [rand(3, 5, 4)], {})],
    "SoftmaxWithLoss": [('type: "SoftmaxWithLoss"', [rand(6, 5), labels(6, 5)], {"check_bottoms": [0]}),
                        ('type: "SoftmaxWithLoss" loss_param { ignore_label: 1 normalization: BATCH_SIZE }',
                         [rand(3, 4, 5), labels(15, 4).reshape(3, 5)], {"check_bottoms": [0]})],
    "Split": [('type: "Split"', [rand(2, 3, 4)], {"num_top": 3})],
    "Swish": [('type: "Swish" swish_param { beta: 1.5 }', [rand(2, 3, 4)], {})],
    "TanH": [('type: "TanH"', [rand(2, 3, 4)], {})],
    "Threshold": [('type: "Threshold" threshold_param { threshold: 0.3 }', [rand(2, 3, 4)],
                   {"check_bottoms": []})],
    "Tile": [('type: "Tile" tile_param { axis: 1 tiles: 3 }', [rand(2, 3, 4)], {})],
}

PARAMS = [pytest.param(text, bottoms, opts, id="%s-%d" % (kind, i))
          for kind, cases in sorted(CASES.items()) for i, (text, bottoms, opts) in enumerate(cases)]


def test_every_layer_type_has_a_case():
    ours = {name for name, cls in LAYER_REGISTRY.items() if cls.__module__.startswith("caffempi.layer_types")}
    assert sorted(ours - FILE_DATA - USER_CODE - set(CASES)) == []


@pytest.mark.parametrize("text,bottoms,opts", PARAMS)
def test_layer_parity(cupy, text, bottoms, opts):
    check_backend_parity(text, bottoms, cupy, **opts)


def test_dropout_train_on_gpu(cupy):
    """The device mask: values 0 or 1/(1-ratio), about 1-ratio kept, the
    gradient through the same mask, and reproducible from the seed."""
    from caffempi.testing.gradient_check import make_layer, run_layer
    x = rand(64, 1000) + 5.0                     # no zeros: y == 0 marks a drop
    text = 'type: "Dropout" dropout_param { dropout_ratio: 0.3 }'
    runs = [run_layer(make_layer(text, xp=cupy, dtype=np.float32), [x], dtype=np.float32, seed=3)
            for _ in range(2)]
    (layer, bottoms, tops), (_, _, again) = runs
    y = cupy.asnumpy(tops[0].data)
    np.testing.assert_array_equal(y, cupy.asnumpy(again[0].data))
    kept = y != 0
    assert abs(kept.mean() - 0.7) < 4 * np.sqrt(0.21 / kept.size)
    np.testing.assert_allclose(y[kept], x.astype(np.float32)[kept] / np.float32(0.7), rtol=1e-6)
    dy = rand(64, 1000, seed=1).astype(np.float32)
    tops[0].diff = cupy.asarray(dy)
    layer.backward(tops, [True], bottoms)
    np.testing.assert_allclose(cupy.asnumpy(bottoms[0].diff), np.where(kept, dy / np.float32(0.7), 0),
                               rtol=1e-6)
