"""convert_imageset: images named in a list file -> LMDB of Datums, as BVLC's
tools/convert_imageset.cpp (keys ``%08d_<filename>``; raw Datums hold C×H×W
bytes in BGR order with encoded=false; ``--encoded`` stores the image file as
is when no resize/colour change is needed and its extension matches, else
re-encodes it).  Images are read and resized with Pillow (bilinear), so
resized pixels may differ slightly from OpenCV's.

    python tools/convert_imageset.py [FLAGS] ROOTFOLDER/ LISTFILE DB_NAME
"""
import argparse
import os

import numpy as np

from ..common import CaffeError
from ..data.datum import array_to_datum, encode_image, encoded_datum, pil_to_chw
from ..data.image_list import read_image_list
from ..data.lmdb_io import LMDBWriter, check_backend
from ._util import info, progress, run_main


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
    check_backend(backend)
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
    with LMDBWriter(db_name) as w:
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


def _main(argv):
    ap = argparse.ArgumentParser(
        prog="convert_imageset",
        description="Convert a set of images to the leveldb/lmdb format used as input for Caffe.")
    ap.add_argument("root_folder")
    ap.add_argument("list_file")
    ap.add_argument("db_name")
    ap.add_argument("--gray", action="store_true", help="load the images in grayscale")
    ap.add_argument("--shuffle", action="store_true", help="randomly shuffle the order of images")
    ap.add_argument("--backend", default="lmdb")
    ap.add_argument("--resize_width", type=int, default=0)
    ap.add_argument("--resize_height", type=int, default=0)
    ap.add_argument("--check_size", action="store_true", help="check that all the datum have the same size")
    ap.add_argument("--encoded", action="store_true", help="store encoded images in the datum")
    ap.add_argument("--encode_type", default="", help="png, jpg, ... (implies --encoded)")
    ap.add_argument("--seed", type=int, default=0, help="seed for --shuffle")
    a = ap.parse_args(argv)
    convert(a.root_folder, a.list_file, a.db_name, a.gray, a.shuffle, a.backend, a.resize_width,
            a.resize_height, a.check_size, a.encoded, a.encode_type, a.seed)


def main(argv=None):
    return run_main(_main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
