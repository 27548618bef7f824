"""`caffempi time`: Caffe's benchmark of forward and backward, layer by layer.

Whole passes are timed, as training runs them, and each layer's share
through the net's per-layer hooks (synchronising the device at each
layer's end); a chain the net runs fused (``Layer.absorb``) is timed on
its first layer's line, its other layers' lines near zero."""
import functools
import os
import time

import numpy as np

from .backend import synchronize
from .common import CaffeError, TRAIN, log
from .io import proto_io
from .memory import measure, tune_allocator
from .net import Net, filter_net, phase_from_name
from .proto import caffe_pb2

# Layers that read their data from files; `time` can stand in for them.
FILE_DATA_TYPES = ("Data", "ImageData", "HDF5Data", "WindowData")


def _data_param(lp):
    return {"Data": lp.data_param, "ImageData": lp.image_data_param,
            "HDF5Data": lp.hdf5_data_param, "WindowData": lp.window_data_param}[lp.type]


def _source_readable(lp):
    source = _data_param(lp).source
    return bool(source) and os.path.exists(source)


def _image_shape(lp, data_shape):
    """(C, H, W) a file data layer would produce, from what the prototxt says."""
    tp = lp.transform_param
    if data_shape:
        return tuple(data_shape)
    if tp.mean_file and os.path.exists(tp.mean_file):
        mean = proto_io.blob_proto_to_array(proto_io.read_binary_proto(tp.mean_file, caffe_pb2.BlobProto))
        c, h, w = mean.shape[-3:]
        return (c, tp.crop_size or h, tp.crop_size or w)
    if tp.crop_size:
        channels = 1 if tp.force_gray else 3
        return (channels, tp.crop_size, tp.crop_size)
    if lp.type == "ImageData" and lp.image_data_param.new_height:
        ip = lp.image_data_param
        return (3 if ip.is_color else 1, ip.new_height, ip.new_width)
    raise CaffeError("layer '%s': cannot read '%s' and the prototxt does not say the image size; "
                     "pass --data_shape=C,H,W" % (lp.name, _data_param(lp).source))


def substitute_data_layers(net_param, data_shape=None, only_unreadable=True, warn=True, batch_size=None):
    """Replace file-reading data layers by Input layers of the same top
    shapes, so any train_val net can be built and timed; fill them with
    :func:`randomize_inputs`.  ``data_shape`` is the per-image shape when the
    prototxt does not say it; ``batch_size`` overrides the layers' own."""
    out = caffe_pb2.NetParameter()
    out.CopyFrom(net_param)
    for lp in out.layer:
        if lp.type not in FILE_DATA_TYPES or (only_unreadable and _source_readable(lp)):
            continue
        n = batch_size or _data_param(lp).batch_size
        shapes = [(n,) + _image_shape(lp, data_shape)] + [(n,)] * (len(lp.top) - 1)
        if warn:
            log.warning("layer '%s': data source unreadable, timing with random input of shape %s",
                        lp.name, " ".join(map(str, shapes[0])))
        keep = caffe_pb2.LayerParameter(name=lp.name, type="Input")
        keep.top.extend(lp.top)
        keep.include.extend(lp.include)
        keep.exclude.extend(lp.exclude)
        for shape in shapes:
            keep.input_param.shape.add().dim.extend(shape)
        lp.CopyFrom(keep)
    return out


def randomize_inputs(net, seed=0):
    """Gaussian values in the first top of every Input layer; other tops
    (labels) stay 0, a valid class for any classifier."""
    rs = np.random.RandomState(seed)
    for layer, tops in zip(net.layers, net.top_vecs):
        if layer.type == "Input" and tops:
            tops[0].data = net.xp.asarray(rs.standard_normal(tops[0].shape), net.dtype)


def time_net(net, iterations=50, report=log.info, measure_memory=True):
    """Run Caffe's benchmark on a built net; returns a dict of averages (ms).
    With ``measure_memory`` one more (traced) pass measures the peak
    activation and gradient bytes under the net's memory mode."""
    n = len(net.layers)
    sync = functools.partial(synchronize, net.xp)
    report("Performing Forward")
    loss = net.forward_range()
    report("Initial loss: %g", loss)
    report("Performing Backward")
    net.backward_range()
    fwd = np.zeros(n)
    bwd = np.zeros(n)
    fwd_total = bwd_total = 0.0
    report("*** Benchmark begins ***")
    report("Testing for %d iterations.", iterations)
    steps = []
    pool = _gpu_memory_pool(net.xp)
    if pool is not None:
        # the pool keeps what it allocates: after the run its size is the
        # most the iterations needed at once (plus fragmentation)
        pool.free_all_blocks()
    started = {}

    def start(i):
        started[i] = time.perf_counter()

    def stopper(times):
        def stop(i):
            sync()
            times[i] += time.perf_counter() - started[i]
        return stop
    hooks = [("before_forward", start), ("after_forward", stopper(fwd)),
             ("before_backward", start), ("after_backward", stopper(bwd))]
    for when, fn in hooks:
        net.add_hook(when, fn)
    try:
        t_all = time.perf_counter()
        for it in range(iterations):
            t_iter = time.perf_counter()
            net.forward_range()
            sync()
            t_f = time.perf_counter()
            fwd_total += t_f - t_iter
            net.backward_range()
            sync()
            bwd_total += time.perf_counter() - t_f
            steps.append(time.perf_counter() - t_iter)
            report("Iteration: %d forward-backward time: %.6g ms.", it + 1, steps[-1] * 1e3)
    finally:
        for when, fn in hooks:
            net.remove_hook(when, fn)
    total = time.perf_counter() - t_all
    report("Average time per layer: ")
    width = max(len(name) for name in net.layer_names)
    for i, name in enumerate(net.layer_names):
        report("%*s\tforward: %.6g ms.", width, name, fwd[i] / iterations * 1e3)
        report("%*s\tbackward: %.6g ms.", width, name, bwd[i] / iterations * 1e3)
    result = {"forward_ms": fwd_total / iterations * 1e3, "backward_ms": bwd_total / iterations * 1e3,
              "layers": [(name, fwd[i] / iterations * 1e3, bwd[i] / iterations * 1e3)
                         for i, name in enumerate(net.layer_names)]}
    result["forward_backward_ms"] = result["forward_ms"] + result["backward_ms"]
    # the median step shrugs off the other tenants' bursts on a shared host
    result["median_forward_backward_ms"] = float(np.median(steps)) * 1e3
    report("Average Forward pass: %.6g ms.", result["forward_ms"])
    report("Average Backward pass: %.6g ms.", result["backward_ms"])
    report("Average Forward-Backward: %.6g ms.", total / iterations * 1e3)
    report("Total Time: %.6g ms.", total * 1e3)
    if pool is not None:
        result["gpu_pool_peak_bytes"] = pool.total_bytes()
        report("Peak GPU memory (CuPy pool): %.1f MB", pool.total_bytes() / 2 ** 20)
    mem = net.memory_summary()
    for key, value in mem.items():
        report("Memory: %s = %d", key, value)
    if measure_memory:
        peak = measure(net, passes=2)
        result["memory"] = peak
        report("Memory: mode = %s", peak["mode"])
        for key in ("peak_activation_bytes", "peak_gradient_bytes", "peak_live_bytes",
                    "predicted_peak_bytes", "peak_traced_bytes"):
            report("Memory: %s = %d", key, peak[key])
    report("*** Benchmark ends ***")
    return result


def _gpu_memory_pool(xp):
    return None if xp is np else xp.get_default_memory_pool()


def _parse_shape(text):
    if not text:
        return None
    try:
        return tuple(int(v) for v in str(text).split(","))
    except ValueError:
        raise CaffeError("--data_shape must be C,H,W (got '%s')" % text)


def time_command(flags):
    """Entry point for `caffempi time` (flags: model, iterations, phase,
    stage, level, weights, data_shape, memory).  Tunes the allocator first
    (:func:`caffempi.memory.tune_allocator`), as train and test do, so that
    the times are those of training."""
    model = getattr(flags, "model", None)
    if not model:
        raise CaffeError("time needs --model=NET.prototxt")
    phase_name = getattr(flags, "phase", None)
    phase = phase_from_name(phase_name) if phase_name else TRAIN
    stages = [s for s in (getattr(flags, "stage", None) or "").split(",") if s]
    level = int(getattr(flags, "level", 0) or 0)
    param = proto_io.read_net_param(model)
    # only the data layers of the timed phase's net need a source (as Caffe,
    # which builds that net alone: a TEST LMDB may be absent when timing TRAIN)
    param.state.phase, param.state.level = phase, level
    param.state.stage.extend(s for s in stages if s not in param.state.stage)    # as Net does
    param = substitute_data_layers(filter_net(param), _parse_shape(getattr(flags, "data_shape", None)))
    from .cli import select_backend
    xp = select_backend(flags)
    tune_allocator()
    net = Net(param, phase=phase, level=level, stages=stages,
              weights=getattr(flags, "weights", None) or None, xp=xp, source_name=model,
              memory=getattr(flags, "memory", None) or None)
    randomize_inputs(net)
    iterations = int(getattr(flags, "iterations", None) or 50)
    time_net(net, iterations)
    return 0


# Caffe's DeviceQuery lines: (label, cudaDeviceProp key, cudaDeviceAttr
# number for keys that CUDA 13 dropped from the struct).
_DEVICE_FIELDS = [
    ("Major revision number", "major", 75), ("Minor revision number", "minor", 76),
    ("Name", "name", None), ("Total global memory", "totalGlobalMem", None),
    ("Total shared memory per block", "sharedMemPerBlock", 8),
    ("Total registers per block", "regsPerBlock", 12), ("Warp size", "warpSize", 10),
    ("Maximum memory pitch", "memPitch", 11), ("Maximum threads per block", "maxThreadsPerBlock", 1),
    ("Maximum dimension of block", "maxThreadsDim", None),
    ("Maximum dimension of grid", "maxGridSize", None), ("Clock rate", "clockRate", 13),
    ("Total constant memory", "totalConstMem", 9), ("Texture alignment", "textureAlignment", 14),
    ("Concurrent copy and execution", "deviceOverlap", 15),
    ("Number of multiprocessors", "multiProcessorCount", 16),
    ("Kernel execution timeout", "kernelExecTimeoutEnabled", 17),
]
_YES_NO = ("deviceOverlap", "kernelExecTimeoutEnabled")


def device_query_command(flags):
    """Entry point for `caffempi device_query --gpu=ID[,ID...]|all`: Caffe's
    per-device property listing."""
    from .backend import check_device_id, parse_gpu_ids, usable_cupy
    gpu = getattr(flags, "gpu", None) or ""
    if not gpu:
        raise CaffeError("device_query needs --gpu=ID (or all)")
    rt = usable_cupy("device_query").cuda.runtime
    count = rt.getDeviceCount()
    for dev in parse_gpu_ids(gpu, count):
        check_device_id("device_query", dev, count)
        log.info("Querying GPUs %d", dev)
        props = rt.getDeviceProperties(dev)
        log.info("%-31s%d", "Device id:", dev)
        for label, key, attr in _DEVICE_FIELDS:
            value = props.get(key)
            if value is None and attr is not None:
                value = rt.deviceGetAttribute(attr, dev)
            if isinstance(value, bytes):
                value = value.decode(errors="replace")
            elif isinstance(value, (tuple, list)):
                value = ", ".join(str(v) for v in value)
            elif key in _YES_NO:
                value = "Yes" if value else "No"
            log.info("%-31s%s", label + ":", value)
    return 0
