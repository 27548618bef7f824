"""Caffe's image list files: one ``path label`` per line."""
from ..common import CaffeError


def read_image_list(source, layer=None):
    """``path label`` lines (the last space separates the label) ->
    [(path, label, line number)]."""
    name = ("layer '%s' (ImageData): " % layer.name) if layer is not None else ""
    try:
        with open(source) as f:
            text = f.read().splitlines()
    except OSError as e:
        raise CaffeError("%scannot read image list %s: %s" % (name, source, e.strerror or e)) from None
    lines = []
    for n, line in enumerate(text, 1):
        line = line.rstrip()
        if not line:
            continue
        pos = line.rfind(" ")
        try:
            if pos < 0:
                raise ValueError
            lines.append((line[:pos], int(line[pos + 1:]), n))
        except ValueError:
            raise CaffeError("%s%s line %d: expected 'path label', got %r" % (name, source, n, line)) from None
    if not lines:
        raise CaffeError("%simage list %s is empty" % (name, source))
    return lines
