"""caffempi.coord_map (pycaffe's caffe.coord_map): each layer type's map,
chains of them between NetSpec tops, crop() on the FCN nets (their published
Crop offsets) and on a real Net whose crop must line pixels up, and the
errors for tops that no map or no crop relates."""
import numpy as np
import pytest

import caffempi as caffe
from caffempi import layers as L, params as P
from caffempi.common import CaffeError
from caffempi.coord_map import (AxisMismatchException, UndefinedMapException, compose, conv_params,
                                coord_map, coord_map_from_to, crop, crop_params, inverse)


def close(m, axis, scale, shift):
    got_axis, got_scale, got_shift = m
    return got_axis == axis and np.allclose(got_scale, scale) and np.allclose(got_shift, shift)


def data(*dims):
    return L.Input(shape=dict(dim=list(dims)))


def test_window_layer_maps_place_outputs_at_window_centres():
    x = data(1, 1, 50, 50)
    # output y's window starts at y*stride - pad: centre y*stride - pad + (extent-1)/2
    conv = L.Convolution(x, num_output=1, kernel_size=5, stride=2, pad=1)
    assert close(coord_map(conv.fn), 1, 0.5, (1 - 2) / 2)
    dilated = L.Convolution(x, num_output=1, kernel_size=3, dilation=3, pad=2)   # extent 7
    assert close(coord_map(dilated.fn), 1, 1, 2 - 3)
    pool = L.Pooling(x, pool=P.Pooling.MAX, kernel_size=3, stride=3)
    assert close(coord_map(pool.fn), 1, 1 / 3, -1 / 3)
    deconv = L.Deconvolution(x, convolution_param=dict(num_output=1, kernel_size=4, stride=2, pad=1))
    assert close(coord_map(deconv.fn), 1, 2, 1.5 - 1)
    assert close(coord_map(L.Im2col(x, kernel_size=3).fn), 1, 1, -1)
    twin = L.Deconvolution(x, num_output=1, kernel_size=5, stride=2, pad=1)
    assert close(compose(coord_map(conv.fn), coord_map(twin.fn)), 1, 1, 0)   # it undoes the convolution


def test_params_read_the_proto_with_its_defaults_and_legacy_fields():
    x = data(1, 1, 30, 30)
    axis, stride, extent, pad = conv_params(L.Convolution(x, num_output=1, kernel_size=[3, 5]).fn)
    assert axis == 1 and list(stride) == [1] and list(extent) == [3, 5] and list(pad) == [0]
    rect = L.Convolution(x, num_output=1, kernel_h=3, kernel_w=5, stride_h=1, stride_w=2, pad_h=0, pad_w=4)
    axis, stride, extent, pad = conv_params(rect.fn)
    assert list(stride) == [1, 2] and list(extent) == [3, 5] and list(pad) == [0, 4]
    pool = L.Pooling(x, kernel_h=2, kernel_w=4, stride_h=2, stride_w=4)
    assert close(coord_map(pool.fn), 1, [0.5, 0.25], [-0.25, -0.375])
    assert [list(v) for v in conv_params(L.Pooling(x, kernel_size=2).fn)[1:]] == [[1], [2], [0]]
    assert crop_params(L.Crop(x, x).fn)[0] == 2 and list(crop_params(L.Crop(x, x).fn)[1]) == [0]
    axis, offset = crop_params(L.Crop(x, x, crop_param=dict(axis=1, offset=[0, 3, 4])).fn)
    assert axis == 1 and list(offset) == [0, 3, 4]


def test_layers_without_a_map():
    x = data(1, 1, 10, 10)
    for top in (L.InnerProduct(x, num_output=3), L.Pooling(x, global_pooling=True), L.Concat(x, x),
                L.Reshape(x, shape=dict(dim=[0, -1]))):
        with pytest.raises(UndefinedMapException):
            coord_map(top.fn)
    with pytest.raises(CaffeError, match="Convolution layer without a kernel size"):
        coord_map(L.Convolution(x, num_output=1).fn)


def test_pass_through_layers_are_the_identity_on_any_axis():
    x = data(1, 1, 10, 10)
    for top in (L.ReLU(x), L.ReLU(x, in_place=True), L.Sigmoid(x), L.Dropout(x), L.BatchNorm(x),
                L.Eltwise(x, x), L.Clip(x, min=0, max=1)):
        assert coord_map(top.fn) == (None, 1, 0)
    conv = L.Convolution(x, num_output=1, kernel_size=3, stride=2)
    assert close(compose(coord_map(L.ReLU(x).fn), coord_map(conv.fn)), 1, 0.5, -0.5)


def test_compose_and_inverse():
    a, b = (1, np.array([2.0]), np.array([3.0])), (1, np.array([0.5]), np.array([-1.0]))
    # a(b(x)) = 2 * (0.5 x - 1) + 3 = x + 1
    assert close(compose(a, b), 1, 1, 1)
    assert close(compose(a, inverse(a)), 1, 1, 0)
    assert close(compose((None, 1, 0), b), 1, 0.5, -1)
    with pytest.raises(AxisMismatchException):
        compose(a, (2, 1, np.array([0.0])))


def conv_pool_deconv(pad=0, pool=2, dstride=2, dpad=0, kernel=3):
    n = caffe.NetSpec()
    n.data = data(1, 1, 64, 64)
    n.conv = L.Convolution(n.data, num_output=4, kernel_size=kernel, pad=pad)
    n.pool = L.Pooling(n.conv, pool=P.Pooling.MAX, kernel_size=pool, stride=pool)
    n.up = L.Deconvolution(n.pool, num_output=4, kernel_size=2 * dstride, stride=dstride, pad=dpad)
    return n


def test_chains_between_tops():
    n = conv_pool_deconv()
    # conv 3x3: x - 1; pool 2: (x - 0.5)/2; deconv 4/2: 2x + 1.5  =>  up = data - 1 + ... = data
    assert close(coord_map_from_to(n.up, n.data), 1, 1, 0)
    assert close(coord_map_from_to(n.pool, n.data), 1, 2, 1.5)         # pool y sits at data 2y + 1.5
    assert close(coord_map_from_to(n.data, n.pool), 1, 0.5, -0.75)
    assert close(coord_map_from_to(n.up, n.up), None, 1, 0)
    n8 = conv_pool_deconv(pool=8, dstride=8)
    assert close(coord_map_from_to(n8.up, n8.data), 1, 1, -3)
    for pad in (1, 4):                              # conv padding shifts one way, deconv padding the other
        for net, shift in ((conv_pool_deconv(pad=pad), -pad), (conv_pool_deconv(dpad=pad), pad),
                           (conv_pool_deconv(pad=pad, dpad=pad), 0)):
            assert close(coord_map_from_to(net.up, net.data), 1, 1, shift)
    # two branches from one top meet through the first top they share
    n.side = L.Convolution(n.data, num_output=4, kernel_size=5, stride=2)
    assert close(coord_map_from_to(n.up, n.side), 1, 0.5, -1)


def test_crop_walks_its_first_bottom_only():
    n = conv_pool_deconv()
    n.ref = data(1, 1, 60, 60)
    n.cut = L.Crop(n.up, n.ref, axis=2, offset=3)
    assert close(coord_map_from_to(n.cut, n.data), 1, 1, 3)
    with pytest.raises(RuntimeError, match="no top from which both"):
        coord_map_from_to(n.cut, n.ref)
    n.cut3 = L.Crop(n.up, n.ref, axis=3, offset=3)  # crops the last axis only: a map on other axes
    with pytest.raises(AxisMismatchException):
        coord_map_from_to(n.cut3, n.data)


def test_crop_builds_the_crop_layer():
    n = conv_pool_deconv(dpad=0, pool=8, dstride=8)
    n.score = crop(n.up, n.data)
    lp = n.to_proto().layer[-1]
    assert lp.type == "Crop" and list(lp.bottom) == ["up", "data"]
    assert lp.crop_param.axis == 2 and list(lp.crop_param.offset) == [3]
    rect = caffe.NetSpec()
    rect.data = data(1, 1, 64, 64)
    rect.conv = L.Convolution(rect.data, num_output=1, kernel_size=[3, 7], pad=[0, 1])
    rect.relu = L.ReLU(rect.conv, in_place=True)
    rect.score = crop(rect.data, rect.relu)
    assert list(rect.to_proto().layer[-1].crop_param.offset) == [1, 2]
    same = crop(L.ReLU(rect.data), rect.data)       # nothing spatial between them
    assert same.fn.params["crop_param"] == dict(axis=2, offset=[0])


def test_crop_refuses_what_no_crop_can_align():
    n = conv_pool_deconv(pool=3, dstride=2)
    with pytest.raises(AssertionError, match="scales differ"):
        crop(n.up, n.data)
    n = conv_pool_deconv(dpad=5)
    with pytest.raises(AssertionError, match="negative offset"):
        crop(n.up, n.data)
    n = conv_pool_deconv(kernel=2, pad=1)           # an even kernel: centres fall between pixels
    with pytest.raises(AssertionError, match="whole number"):
        crop(n.up, n.data)
    with pytest.raises(CaffeError, match="not a Top"):
        coord_map_from_to(n.up, L.Silence(n.data, ntop=0))


def fcn(stride):
    """BVLC's FCN-32s/16s/8s (fcn.berkeleyvision.org) on VGG16, with few
    channels: conv1_1's pad of 100, fc6 as a 7x7 convolution, the learned
    upsamplings and the crops that align the skips and the output."""
    n = caffe.NetSpec()
    n.data = data(1, 3, 36, 44)
    top, pools = n.data, []
    for stage, convs in enumerate((2, 2, 3, 3, 3), 1):
        for i in range(1, convs + 1):
            pad = 100 if (stage, i) == (1, 1) else 1
            n["conv%d_%d" % (stage, i)] = top = L.Convolution(top, num_output=2, kernel_size=3, pad=pad)
            n["relu%d_%d" % (stage, i)] = top = L.ReLU(top, in_place=True)
        n["pool%d" % stage] = top = L.Pooling(top, pool=P.Pooling.MAX, kernel_size=2, stride=2)
        pools.append(top)
    n.fc6 = L.Convolution(top, num_output=4, kernel_size=7)
    n.relu6 = L.ReLU(n.fc6, in_place=True)
    n.drop6 = L.Dropout(n.relu6, in_place=True)
    n.fc7 = L.Convolution(n.drop6, num_output=4, kernel_size=1)
    n.score_fr = L.Convolution(L.ReLU(n.fc7, in_place=True), num_output=3, kernel_size=1)
    top = n.score_fr
    for level, pool in ((4, pools[3]), (3, pools[2]))[:{32: 0, 16: 1, 8: 2}[stride]]:
        n["upscore%d" % level] = up = L.Deconvolution(top, num_output=3, kernel_size=4, stride=2,
                                                      bias_term=False)
        n["score_pool%d" % level] = L.Convolution(pool, num_output=3, kernel_size=1)
        n["score_pool%dc" % level] = crop(n["score_pool%d" % level], up)
        n["fuse_pool%d" % level] = top = L.Eltwise(up, n["score_pool%dc" % level], operation=P.Eltwise.SUM)
    n.upscore = L.Deconvolution(top, num_output=3, kernel_size=2 * stride, stride=stride, bias_term=False)
    n.score = crop(n.upscore, n.data)
    return n


@pytest.mark.parametrize("stride, offsets", [(32, {"score": 19}),
                                             (16, {"score_pool4c": 5, "score": 27}),
                                             (8, {"score_pool4c": 5, "score_pool3c": 9, "score": 31})])
def test_fcn_crop_offsets_are_the_published_ones(stride, offsets):
    proto = fcn(stride).to_proto()
    crops = {lp.name: list(lp.crop_param.offset) for lp in proto.layer if lp.type == "Crop"}
    assert crops == {name: [offset] for name, offset in offsets.items()}
    if stride == 8:                                 # and the net runs: every crop fits, the output is the input's size
        net = caffe.Net(proto, caffe.TEST)
        net.forward()
        assert net.blobs["score"].data.shape == (1, 3, 36, 44)


def test_a_crop_from_crop_lines_pixels_up_in_a_net():
    """A stride-2 convolution that picks one pixel per window (a delta kernel)
    and a stride-2 deconvolution that puts it back at its window's centre:
    after crop(up, data), each pixel the two kept is where it was in data."""
    for pad in (0, 1):
        n = caffe.NetSpec()
        n.data = data(1, 1, 11, 13)
        n.down = L.Convolution(n.data, num_output=1, kernel_size=3, stride=2, pad=pad, bias_term=False)
        n.up = L.Deconvolution(n.down, num_output=1, kernel_size=3, stride=2, bias_term=False)
        n.aligned = crop(n.up, n.data)
        net = caffe.Net(n.to_proto(), caffe.TEST)
        delta = np.zeros((1, 1, 3, 3), np.float32)
        delta[..., 1, 1] = 1
        net.params["down"][0].data[...] = delta
        net.params["up"][0].data[...] = delta
        image = np.arange(11 * 13, dtype=np.float32).reshape(1, 1, 11, 13) + 1
        net.blobs["data"].data[...] = image
        net.forward()
        out = net.blobs["aligned"].data
        kept = out != 0
        assert kept.sum() == net.blobs["down"].data.size
        np.testing.assert_array_equal(out[kept], image[:, :, :out.shape[2], :out.shape[3]][kept])
