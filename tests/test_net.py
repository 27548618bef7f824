"""Net construction (filtering, splits, in-place, sharing, backward pruning),
whole-net gradients, and .caffemodel round trips."""
import numpy as np
import pytest
from google.protobuf import text_format

from caffempi import Net, TEST, TRAIN, CaffeError, set_random_seed
from caffempi.io import proto_io
from caffempi.proto import caffe_pb2


def net_param(text):
    p = caffe_pb2.NetParameter()
    text_format.Merge(text, p)
    return p


MLP = """
name: "mlp"
layer { name: "data" type: "Input" top: "data" top: "target"
        input_param { shape { dim: 4 dim: 3 } shape { dim: 4 dim: 2 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
        param { name: "w1" } param { lr_mult: 2 }
        inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.5 }
                              bias_filler { type: "uniform" min: -0.1 max: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "ip2" bottom: "target" top: "loss" }
"""


def make_mlp(**kw):
    set_random_seed(3)
    net = Net(net_param(MLP), **kw)
    rs = np.random.RandomState(0)
    net.blobs["data"].data[...] = rs.randn(4, 3)
    net.blobs["target"].data[...] = rs.randn(4, 2)
    return net


def test_blob_and_param_access():
    net = make_mlp()
    assert list(net.blobs) == ["data", "target", "ip1", "ip2", "loss"]
    assert net.blobs["ip1"].data.shape == (4, 5)
    assert [p.data.shape for p in net.params["ip1"]] == [(5, 3), (5,)]
    assert net.param_lr_mults == [1, 2, 1, 1]
    assert net.outputs == ["loss"]
    assert net.inputs == ["data", "target"]
    # parameters are views of the flat buffers, in layer order
    assert net.param_data.size == 5 * 3 + 5 + 2 * 5 + 2
    net.params["ip2"][0].data[...] = 7
    assert np.all(net.param_data[20:30] == 7)


def test_whole_net_gradient_matches_finite_differences():
    net = make_mlp(dtype=np.float64)
    net.clear_param_diffs()
    net.forward_backward()
    analytic = net.param_diff.copy()
    eps = 1e-6
    numeric = np.zeros_like(analytic)
    for i in range(net.param_data.size):
        orig = net.param_data[i]
        net.param_data[i] = orig + eps
        plus = net.forward_range()
        net.param_data[i] = orig - eps
        minus = net.forward_range()
        net.param_data[i] = orig
        numeric[i] = (plus - minus) / (2 * eps)
    np.testing.assert_allclose(analytic, numeric, rtol=1e-5, atol=1e-8)


def test_param_diffs_accumulate_and_clear():
    net = make_mlp(dtype=np.float64)
    net.clear_param_diffs()
    net.forward_backward()
    once = net.param_diff.copy()
    net.forward_backward()
    np.testing.assert_allclose(net.param_diff, 2 * once)
    net.clear_param_diffs()
    assert not net.param_diff.any()


def test_diffs_written_by_another_are_left_by_the_clear():
    """Params whose gradients something else writes whole (the sufficient
    factors) keep their diffs through clear_param_diffs; the rest are
    zeroed, and an empty set clears everything again."""
    net = make_mlp(dtype=np.float64)
    net.param_diff[...] = 3.0
    net.set_diffs_written([0, 2])            # ip1's weight, ip2's weight
    net.clear_param_diffs()
    kept = [bool(np.all(b.diff == 3.0)) for b in net.learnable_params]
    cleared = [not b.diff.any() for b in net.learnable_params]
    assert kept == [True, False, True, False] and cleared == [False, True, False, True]
    assert net.param_ranges(0, net.param_diff.size, [0, 2]) == [(15, 20), (30, 32)]
    net.set_diffs_written([])
    net.clear_param_diffs()
    assert not net.param_diff.any()


def test_split_inserted_for_fanout_with_caffe_names():
    p = net_param("""
      layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } }
      layer { name: "a" type: "ReLU" bottom: "x" top: "a" }
      layer { name: "b" type: "Sigmoid" bottom: "x" top: "b" }
      layer { name: "sum" type: "Eltwise" bottom: "a" bottom: "b" top: "s" }
    """)
    net = Net(p)
    assert "in_x_0_split" in net.layer_names
    split = net.layer("in_x_0_split")
    assert split.type == "Split"
    assert net.bottom_names[net.layer_names.index("a")] == ["x_in_0_split_0"]
    assert net.bottom_names[net.layer_names.index("b")] == ["x_in_0_split_1"]


def test_split_gradient_sums_both_branches():
    p = net_param("""
      force_backward: true
      layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } }
      layer { name: "p1" type: "Power" bottom: "x" top: "p1" power_param { scale: 2 } }
      layer { name: "p2" type: "Power" bottom: "x" top: "p2" power_param { scale: 3 } }
      layer { name: "sum" type: "Eltwise" bottom: "p1" bottom: "p2" top: "s" }
      layer { name: "loss" type: "Reduction" bottom: "s" top: "loss" loss_weight: 1 }
    """)
    net = Net(p, dtype=np.float64)
    net.blobs["x"].data[...] = 1
    net.forward_backward()
    np.testing.assert_allclose(net.blobs["x"].diff, 5.0)


def test_include_exclude_by_phase_stage_level():
    p = net_param("""
      layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 1 } } }
      layer { name: "tr" type: "ReLU" bottom: "x" top: "t1" include { phase: TRAIN } }
      layer { name: "te" type: "ReLU" bottom: "x" top: "t2" include { phase: TEST } }
      layer { name: "st" type: "ReLU" bottom: "x" top: "t3" include { stage: "deploy" } }
      layer { name: "nst" type: "ReLU" bottom: "x" top: "t4" exclude { stage: "deploy" } }
      layer { name: "lvl" type: "ReLU" bottom: "x" top: "t5" include { min_level: 2 } }
    """)
    names = lambda **kw: set(Net(p, **kw).layer_names) - {"in", "in_x_0_split"}
    assert names(phase=TRAIN) == {"tr", "nst"}
    assert names(phase=TEST) == {"te", "nst"}
    assert names(phase=TEST, stages=["deploy"]) == {"te", "st"}
    assert names(phase=TRAIN, level=3) == {"tr", "nst", "lvl"}


def test_loss_weight_defaults_and_override():
    net = make_mlp()
    assert net.loss_weights[net.layer_names.index("loss")] == [(0, 1.0)]
    p = net_param(MLP.replace('top: "loss" }', 'top: "loss" loss_weight: 0.5 }'))
    net2 = Net(p)
    assert net2.loss_weights[net2.layer_names.index("loss")] == [(0, 0.5)]


def test_backward_pruning_and_propagate_down():
    net = make_mlp()
    i = net.layer_names.index
    assert not net.layer_need_backward[i("data")]
    assert net.layer_need_backward[i("ip1")]
    # inputs need no gradient unless forced
    assert net.bottom_need_backward[i("ip1")] == [False]
    assert net.bottom_need_backward[i("loss")] == [True, False]
    forced = Net(net_param("force_backward: true\n" + MLP))
    assert forced.bottom_need_backward[forced.layer_names.index("ip1")] == [True]
    # a layer whose params are frozen and whose bottoms need no gradient is skipped
    frozen = Net(net_param(MLP.replace('param { name: "w1" } param { lr_mult: 2 }',
                                       'param { lr_mult: 0 } param { lr_mult: 0 }')))
    assert not frozen.layer_need_backward[frozen.layer_names.index("ip1")]
    # propagate_down: false stops the gradient below ip2
    stopped = Net(net_param(MLP.replace('bottom: "ip1" top: "ip2"',
                                        'bottom: "ip1" top: "ip2" propagate_down: false')))
    j = stopped.layer_names.index
    assert stopped.bottom_need_backward[j("ip2")] == [False]
    assert not stopped.layer_need_backward[j("ip1")]


def test_layer_not_under_loss_skips_backward():
    p = net_param(MLP + """
      layer { name: "side" type: "InnerProduct" bottom: "data" top: "side"
              inner_product_param { num_output: 1 } }""")
    net = Net(p)
    assert not net.layer_need_backward[net.layer_names.index("side")]


def test_shared_params_are_one_blob_and_shape_checked():
    shared = MLP.replace('bottom: "ip1" top: "ip2"', 'bottom: "ip1" top: "ip2" param { name: "w2" }') + """
      layer { name: "ip3" type: "InnerProduct" bottom: "ip1" top: "ip3" param { name: "w2" }
              inner_product_param { num_output: 2 } }"""
    net = Net(net_param(shared))
    assert net.params["ip3"][0] is net.params["ip2"][0]
    assert len(net.learnable_params) == 5        # w1, b1, w2, b2, b3
    bad = shared.replace('top: "ip3" param { name: "w2" }\n              inner_product_param { num_output: 2 }',
                         'top: "ip3" param { name: "w2" }\n              inner_product_param { num_output: 3 }')
    with pytest.raises(CaffeError, match=r"cannot share param 'w2'.*\(2, 5\).*\(3, 5\)"):
        Net(net_param(bad))


def test_shared_param_gradient_accumulates_from_both_users():
    p = net_param("""
      force_backward: true
      layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } }
      layer { name: "a" type: "InnerProduct" bottom: "x" top: "a" param { name: "w" }
              inner_product_param { num_output: 2 bias_term: false weight_filler { type: "constant" value: 1 } } }
      layer { name: "b" type: "InnerProduct" bottom: "x" top: "b" param { name: "w" }
              inner_product_param { num_output: 2 bias_term: false } }
      layer { name: "s" type: "Eltwise" bottom: "a" bottom: "b" top: "s" }
      layer { name: "loss" type: "Reduction" bottom: "s" top: "loss" loss_weight: 1 }
    """)
    net = Net(p, dtype=np.float64)
    net.blobs["x"].data[...] = np.arange(6).reshape(2, 3)
    net.clear_param_diffs()
    net.forward_backward()
    # d/dW of sum(xW^T) used twice = 2 * column sums of x, for each output row
    np.testing.assert_allclose(net.params["a"][0].diff, 2 * np.tile([3, 5, 7], (2, 1)))


def test_errors_name_layer_and_blob():
    with pytest.raises(CaffeError, match=r"layer 'r': unknown bottom blob 'nope'"):
        Net(net_param('layer { name: "r" type: "ReLU" bottom: "nope" top: "y" }'))
    with pytest.raises(CaffeError, match=r"layer 'z': unknown layer type 'Zorp'.*known types:.*Convolution"):
        Net(net_param('layer { name: "z" type: "Zorp" top: "y" }'))
    with pytest.raises(CaffeError, match=r"prototxt:2:"):
        import tempfile, os
        with tempfile.TemporaryDirectory() as d:
            f = os.path.join(d, "bad.prototxt")
            open(f, "w").write('name: "x"\nlayer { nme: "r" }\n')
            Net(f)


def test_data_layer_types_exist_or_fail_clearly():
    from caffempi.layer_types.base import LAYER_REGISTRY
    for t in ("Input", "DummyData", "Convolution", "SoftmaxWithLoss", "BatchNorm"):
        assert t in LAYER_REGISTRY


def test_caffemodel_round_trip_and_legacy_shapes(tmp_path):
    net = make_mlp()
    path = tmp_path / "w.caffemodel"
    net.save(str(path))
    other = make_mlp()
    other.param_data[...] = 0
    other.copy_from(str(path))
    np.testing.assert_array_equal(other.param_data, net.param_data)
    # a Caffe-written model in the legacy num/channels/height/width form
    legacy = caffe_pb2.NetParameter()
    lp = legacy.layer.add(name="ip2", type="InnerProduct")
    w = lp.blobs.add(num=1, channels=1, height=2, width=5)
    w.data.extend(np.arange(10, dtype=np.float32))
    b = lp.blobs.add(num=1, channels=1, height=1, width=2)
    b.data.extend([1.5, -2])
    other.copy_from(legacy)
    np.testing.assert_array_equal(other.params["ip2"][0].data, np.arange(10).reshape(2, 5))
    np.testing.assert_array_equal(other.params["ip2"][1].data, [1.5, -2])
    bad = caffe_pb2.NetParameter()
    bl = bad.layer.add(name="ip2", type="InnerProduct")
    bl.blobs.add().shape.dim.extend([3, 5])
    bl.blobs[0].data.extend(np.zeros(15))
    bl.blobs.add().shape.dim.extend([2])
    bl.blobs[1].data.extend([0, 0])
    with pytest.raises(CaffeError, match=r"layer 'ip2'.*\(3, 5\).*\(2, 5\)"):
        other.copy_from(bad)


def test_saved_caffemodel_is_plain_netparameter(tmp_path):
    net = make_mlp()
    path = tmp_path / "w.caffemodel"
    net.save(str(path))
    p = caffe_pb2.NetParameter()
    p.ParseFromString(path.read_bytes())
    ip1 = [l for l in p.layer if l.name == "ip1"][0]
    assert list(ip1.blobs[0].shape.dim) == [5, 3]
    np.testing.assert_array_equal(proto_io.blob_proto_to_array(ip1.blobs[0]), net.params["ip1"][0].data)


def test_hdf5_weights_round_trip(tmp_path):
    net = make_mlp()
    path = str(tmp_path / "w.caffemodel.h5")
    net.save_hdf5(path)
    other = make_mlp()
    other.param_data[...] = 0
    other.copy_from(path)
    np.testing.assert_array_equal(other.param_data, net.param_data)


def test_pycaffe_forward_backward_api():
    net = make_mlp(dtype=np.float64)
    out = net.forward(data=np.ones((4, 3)))
    assert set(out) == {"loss"}
    diffs = net.backward()
    assert set(diffs) == {"data", "target"}


def test_v1_and_input_dim_nets_build():
    p = net_param("""
      input: "data" input_dim: 2 input_dim: 3 input_dim: 4 input_dim: 4
      layers { name: "conv" type: CONVOLUTION bottom: "data" top: "conv"
               blobs_lr: 1 blobs_lr: 2 convolution_param { num_output: 2 kernel_size: 3 } }
      layers { name: "relu" type: RELU bottom: "conv" top: "conv" }
    """)
    net = Net(p)
    assert net.layer_names == ["input", "conv", "relu"]
    assert net.blobs["conv"].shape == (2, 2, 2, 2)
    assert net.param_lr_mults == [1, 2]


def test_pycaffe_constructor_forms_and_modes(tmp_path, monkeypatch):
    """caffe.Net(model, weights, phase) and Net(model, phase, weights=...)
    build the same net; set_mode_cpu/gpu choose the array module of nets made
    without ``xp``, and without a GPU set_mode_gpu says so."""
    import caffempi
    from caffempi import backend
    model = tmp_path / "mlp.prototxt"
    model.write_text(MLP)
    set_random_seed(5)
    src = Net(str(model), TRAIN)
    src.params["ip1"][0].data[...] = 0.25
    weights = tmp_path / "mlp.caffemodel"
    src.save(str(weights))
    a = Net(str(model), str(weights), TEST)                  # pycaffe's classic form
    b = Net(str(model), TEST, weights=str(weights))
    assert a.phase == b.phase == TEST
    np.testing.assert_array_equal(a.param_data, b.param_data)
    np.testing.assert_array_equal(a.param_data, src.param_data)
    caffempi.set_mode_cpu()
    assert Net(str(model), TEST).xp is np
    monkeypatch.setattr(backend, "_cupy", False)             # as on a machine without CuPy
    for fn, args in ((caffempi.set_mode_gpu, ()), (caffempi.set_device, (0,))):
        with pytest.raises(CaffeError, match="no usable GPU"):
            fn(*args)
    assert Net(str(model), TEST).xp is np                    # the mode did not change
