"""Caffe's command-line data tools (convert_mnist_data, convert_cifar_data,
convert_imageset, compute_image_mean, extract_features), proto upgrade tools
(upgrade_net_proto_text/_binary, upgrade_solver_proto_text) and log tools
(parse_log, plot_training_log).  Each declares its command line with
caffempi.flags (gflags style, with glog's flags, as BVLC's tools) and has a
``main(argv=None)`` (the upgrade tools one function each); ``tools/X.py``
runs it."""
