"""Build a small real data set in MNIST's IDX format, with no network.

scikit-learn ships 1,797 8x8 handwritten digits (UCI). Each is upscaled to
28x28 (bilinear) and scaled to 0..255, then written as the four files
``ds.MnistDataset`` reads: ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``. A fixed seed splits
1,497 training and 300 held-out images.
"""

from __future__ import annotations

import argparse
import os
import struct

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits


def write_idx(path: str, array: np.ndarray) -> None:
    dtype_code = 0x08  # unsigned byte
    with open(path, "wb") as f:
        f.write(struct.pack(">HBB", 0, dtype_code, array.ndim))
        f.write(struct.pack(">" + "I" * array.ndim, *array.shape))
        f.write(array.astype(np.uint8).tobytes())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--test-size", type=int, default=300)
    args = p.parse_args()
    digits = load_digits()
    images = (digits.images / 16.0 * 255.0).astype(np.float32)
    big = np.stack([np.asarray(Image.fromarray(im).resize((28, 28), Image.BILINEAR)) for im in images])
    big = np.clip(big, 0, 255).astype(np.uint8)
    labels = digits.target.astype(np.uint8)
    order = np.random.default_rng(0).permutation(len(labels))
    test, train = order[: args.test_size], order[args.test_size:]
    os.makedirs(args.out, exist_ok=True)
    write_idx(os.path.join(args.out, "train-images-idx3-ubyte"), big[train])
    write_idx(os.path.join(args.out, "train-labels-idx1-ubyte"), labels[train])
    write_idx(os.path.join(args.out, "t10k-images-idx3-ubyte"), big[test])
    write_idx(os.path.join(args.out, "t10k-labels-idx1-ubyte"), labels[test])
    print(f"wrote {len(train)} training and {len(test)} test images to {args.out}")


if __name__ == "__main__":
    main()
