"""convert_imageset: images named in a list file -> LMDB or LevelDB of Datums, as BVLC's
tools/convert_imageset.cpp (keys ``%08d_<filename>``; raw Datums hold C×H×W
bytes in BGR order with encoded=false; ``--encoded`` stores the image file as
is when no resize/colour change is needed and its extension matches, else
re-encodes it).  Images are read and resized with Pillow (bilinear), so
resized pixels may differ slightly from OpenCV's.

    python tools/convert_imageset.py [FLAGS] ROOTFOLDER/ LISTFILE DB_NAME
"""
import os

import numpy as np

from ..common import CaffeError
from ..data.datum import array_to_datum, encode_image, encoded_datum, pil_to_chw
from ..data.image_list import read_image_list
from ..data.db import backend_name, open_writer
from ..flags import FlagSet
from ._util import info, progress, run_tool


def read_image(path, height=0, width=0, is_color=True):
    """Caffe's ReadImageToCVMat: C×H×W uint8 (BGR or grey), resized when both
    height and width are positive."""
    from PIL import Image
    try:
        with Image.open(path) as img:
            img.load()
            img = img.convert("RGB" if is_color else "L")
    except OSError as e:
        raise CaffeError("could not open or find file %s (%s)" % (path, e)) from None
    if height > 0 and width > 0:
        img = img.resize((width, height), Image.BILINEAR)
    return pil_to_chw(img, is_color)


def image_to_datum(path, label, height=0, width=0, is_color=True, encoding=""):
    """Caffe's ReadImageToDatum."""
    img = read_image(path, height, width, is_color)
    if encoding:
        ext = os.path.splitext(path)[1][1:].lower()
        same = ext == encoding.lower() or (ext in ("jpg", "jpeg") and encoding.lower() in ("jpg", "jpeg"))
        if (img.shape[0] == 3) == is_color and not height and not width and same:
            with open(path, "rb") as f:
                return encoded_datum(f.read(), label)
        return encoded_datum(encode_image(img, encoding), label)
    d = array_to_datum(img, label)
    d.encoded = False
    return d


def convert(root, list_file, db_name, gray=False, shuffle=False, backend="lmdb",
            resize_width=0, resize_height=0, check_size=False, encoded=False,
            encode_type="", seed=0):
    backend_name(backend)
    lines = [(path, label) for path, label, _ in read_image_list(list_file)]
    if shuffle:
        info("Shuffling data")
        order = np.random.RandomState(seed).permutation(len(lines))
        lines = [lines[i] for i in order]
    info("A total of %d images.", len(lines))
    if encode_type and not encoded:
        info("encode_type specified, assuming encoded=true.")
        encoded = True
    count = 0
    data_size = None
    with open_writer(db_name, backend) as w:
        for line_id, (fn, label) in enumerate(progress(lines, len(lines), os.path.basename(db_name))):
            enc = encode_type
            if encoded and not enc:
                p = fn.rfind(".")
                if p < 0:
                    info("Failed to guess the encoding of '%s'", fn)
                enc = fn[p + 1:].lower() if p >= 0 else ""
            path = os.path.join(root, fn) if root else fn
            if not os.path.exists(path):
                raise CaffeError("%s: image %s (line %d of %s) does not exist"
                                 % (db_name, path, line_id + 1, list_file))
            d = image_to_datum(path, label, resize_height, resize_width, not gray, enc)
            if check_size:
                if data_size is None:
                    data_size = len(d.data)
                elif len(d.data) != data_size:
                    raise CaffeError("%s: incorrect data field size %d (expected %d)"
                                     % (fn, len(d.data), data_size))
            w.put("%08d_%s" % (line_id, fn), d.SerializeToString())
            count += 1
    info("Processed %d files.", count)
    return count


FLAGS = FlagSet("convert_imageset", "Convert a set of images to the leveldb/lmdb format used as input for Caffe.")
FLAGS.argument("ROOTFOLDER/", "the folder that the list's file names are relative to")
FLAGS.argument("LISTFILE", "one image a line: its file name, a space, its label")
FLAGS.argument("DB_NAME", "the database to create")
FLAGS.define("gray", False, "When this option is on, treat images as grayscale ones")
FLAGS.define("shuffle", False, "Randomly shuffle the order of images and their labels")
FLAGS.define("backend", "lmdb", "The backend {lmdb, leveldb} for storing the result")
FLAGS.define("resize_width", 0, "Width images are resized to")
FLAGS.define("resize_height", 0, "Height images are resized to")
FLAGS.define("check_size", False, "When this option is on, check that all the datum have the same size")
FLAGS.define("encoded", False, "When this option is on, the encoded image will be saved in datum")
FLAGS.define("encode_type", "", "Optional: What type should we encode the image as ('png','jpg',...); "
             "implies --encoded")
FLAGS.define("seed", 0, "The seed of --shuffle's order (caffempi's own flag)")


def _main(flags, root_folder, list_file, db_name):
    convert(root_folder, list_file, db_name, flags.gray, flags.shuffle, flags.backend, flags.resize_width,
            flags.resize_height, flags.check_size, flags.encoded, flags.encode_type, flags.seed)


def main(argv=None):
    return run_tool(FLAGS, _main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
