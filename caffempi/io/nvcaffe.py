"""NVCaffe (Caffe-MPI 2.0) fields in caffempi's schema and what each does.

proto/caffe.proto carries the NVCaffe fields that its model zoo and
snapshots use; ``HONOURED`` ones act as in NVCaffe, ``IGNORED`` ones are
accepted and reported by :func:`warn_ignored_fields` when a file sets them to
anything but their default.  NVCaffe fields absent from the schema (the
SSD/DetectNet/TensorRT layers' parameters, for instance) are refused by the
parser, naming the field.  docs/nvcaffe.md is the same table for users.
"""
from ..common import log
from ..proto.fields import is_repeated

HONOURED = {
    "BlobProto": ("raw_data_type", "raw_diff_type", "raw_data", "raw_diff"),
    "BatchNormParameter": ("scale_bias", "scale_filler", "bias_filler"),
    "DataParameter": ("threads", "cache", "shuffle"),
    "SolverParameter": ("rampup_interval", "rampup_lr", "min_lr", "store_blobs_in_old_format"),
}

IGNORED = {
    "NetParameter": ("default_forward_type", "default_backward_type", "default_forward_math",
                     "default_backward_math", "global_grad_scale", "global_grad_scale_adaptive",
                     "default_conv_algos_override", "reduce_buckets", "default_cudnn_math_override",
                     "eltwise_mem_sharing"),
    "LayerParameter": ("forward_type", "backward_type", "forward_math", "backward_math"),
    "DataParameter": ("parser_threads", "precache"),
    "SolverParameter": ("solver_data_type", "momentum_policy", "max_momentum", "momentum_power",
                        "larc", "larc_policy", "larc_eta", "larc_turbo", "weight_decay_policy",
                        "weight_decay_power", "max_weight_decay", "test_and_snapshot_last_epochs",
                        "eval_type", "ap_version", "plateau_winsize", "show_per_class_result"),
}

_warned = set()


def ignored_fields(msg, found=None):
    """{"Message.field": times set} for the IGNORED fields that ``msg`` and
    its sub-messages set to anything but the default."""
    found = {} if found is None else found
    ignored = IGNORED.get(msg.DESCRIPTOR.name, ())
    for field, value in msg.ListFields():
        if field.name in ignored and (is_repeated(field) or value != field.default_value):
            name = "%s.%s" % (msg.DESCRIPTOR.name, field.name)
            found[name] = found.get(name, 0) + 1
        if field.message_type is not None and field.message_type.name != "BlobProto":
            for sub in (value if is_repeated(field) else (value,)):
                ignored_fields(sub, found)
    return found


def warn_ignored_fields(msg, source_name):
    """One warning line per file naming the IGNORED NVCaffe fields it sets."""
    found = ignored_fields(msg)
    key = (source_name, tuple(sorted(found)))
    if found and key not in _warned:
        _warned.add(key)
        log.warning("%s: NVCaffe fields without effect in caffempi (docs/nvcaffe.md): %s", source_name,
                    ", ".join(n if c == 1 else "%s (%d times)" % (n, c) for n, c in sorted(found.items())))
