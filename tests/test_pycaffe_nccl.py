"""caffe.has_nccl() agrees with caffe.NCCL: True only where NCCL.new_uid()
gives a uid (bytes) and NCCL(solver, uid) is accepted.  caffempi refuses
pycaffe's NCCL recipe (its ranks are MPI processes), so has_nccl() is False
on every machine, GPUs with NCCL included; whether caffempi's own NCCL
transport can run is nccl_transport_available()."""
import pytest

import caffempi as caffe
from caffempi.backend import cupy_or_none
from caffempi.common import CaffeError
from caffempi.pycaffe import nccl_transport_available


def nccl_call_works(call):
    try:
        return call()
    except CaffeError:
        return None


def test_has_nccl_is_true_only_where_nccl_works():
    uid = nccl_call_works(caffe.NCCL.new_uid)
    joined = nccl_call_works(lambda: caffe.NCCL(None, uid))
    assert caffe.has_nccl() is (isinstance(uid, bytes) and joined is not None)
    assert caffe.has_nccl() is False


def test_pycaffe_test_nccl_reading():
    """BVLC's test_nccl.py: where has_nccl() says so, new_uid() is bytes."""
    if caffe.has_nccl():
        assert isinstance(caffe.NCCL.new_uid(), bytes)
    else:
        with pytest.raises(CaffeError, match="mpiexec"):
            caffe.NCCL.new_uid()


def test_nccl_transport_available_says_whether_cupy_loads_nccl_on_a_gpu():
    cp = cupy_or_none()
    expected = False
    if cp is not None:
        try:
            from cupy.cuda import nccl
            expected = cp.cuda.runtime.getDeviceCount() > 0 and bool(nccl.available)
        except Exception:
            expected = False
    assert nccl_transport_available() is expected
