"""Caffe's command-line data tools (convert_mnist_data, convert_cifar_data,
convert_imageset, compute_image_mean) and log tools (parse_log,
plot_training_log).  Each module has ``main(argv=None)``; ``tools/X.py`` runs it."""
