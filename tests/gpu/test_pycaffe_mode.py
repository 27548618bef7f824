"""pycaffe's caffe.set_mode_gpu()/set_device() on a real device."""
import numpy as np

import caffempi
from caffempi import Net, TEST

from test_net import MLP


def test_set_mode_gpu_puts_new_nets_on_the_device(cupy, tmp_path):
    model = tmp_path / "mlp.prototxt"
    model.write_text(MLP)
    try:
        caffempi.set_device(0)
        caffempi.set_mode_gpu()
        net = Net(str(model), TEST)
        assert net.xp is cupy and isinstance(net.param_data, cupy.ndarray)
        net.blobs["data"].data[...] = cupy.ones((4, 3), np.float32)
        assert np.isfinite(float(net.forward()["loss"]))
    finally:
        caffempi.set_mode_cpu()
    assert Net(str(model), TEST).xp is np
