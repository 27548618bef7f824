"""backend/llvm.py: the builder's idioms compile and run, from several
threads at once (the kernels compile when first used, on the chunks'
threads)."""
import ctypes
import threading

import numpy as np
import pytest

from caffempi.backend import llvm

pytestmark = pytest.mark.skipif(llvm.compile_module("", ()) is None, reason="needs x86-64 and llvmlite")


def scaled_copy_ir():
    """scaled(src, dst, n, scale): dst[i] = src[i] * scale, 8 at a time
    while 8 remain, then one at a time."""
    m = llvm.Builder("test", 8)
    fn, b = m.function("scaled", [m.fp, m.fp, m.i64, m.f32])
    src, dst, n, scale = fn.args
    whole = b.sdiv(n, m.const(8))

    def vectors(i, _):
        at = b.mul(i, m.const(8))
        m.store_vector(b, b.fmul(m.vector_at(b, src, at), m.spread(b, scale)), dst, at)
    m.counted(b, whole, vectors)
    first = b.mul(whole, m.const(8))

    def one(i, _):
        at = b.add(first, i)
        b.store(b.fmul(b.load(b.gep(src, [at])), scale), b.gep(dst, [at]))
    m.counted(b, b.sub(n, first), one)
    b.ret_void()
    return str(m.module)


def test_compiles_from_several_threads_at_once():
    text, compiled, errors = scaled_copy_ir(), [], []
    arguments = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float]

    def compile_one():
        try:
            compiled.append(llvm.compile_functions(text, (), {"scaled": arguments})["scaled"])
        except Exception as e:          # noqa: BLE001 (reported below)
            errors.append(e)
    workers = [threading.Thread(target=compile_one) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors and len(compiled) == 4
    src = np.arange(19, dtype=np.float32)
    for scaled in compiled:
        dst = np.zeros_like(src)
        scaled(src.ctypes.data, dst.ctypes.data, src.size, 0.5)
        np.testing.assert_array_equal(dst, src * np.float32(0.5))


def test_missing_cpu_feature_gives_none():
    assert llvm.compile_functions(scaled_copy_ir(), ("no-such-feature",), {"scaled": []}) is None
