"""Build the shipped CIFAR-10 subset (`vitscope/data/shipped/cifar10_test_1k.npz`) from an ImageFolder copy of
the CIFAR-10 test split: the first 100 files (sorted by name) of each of the 10 class folders.

    python tools/make_cifar10_test_1k.py ../shared/data/cifar10/test

The array holds the decoded pixels (uint8, 1000 x 32 x 32 x 3), the labels, the class names and the source
file of every image (``<class>/<file>``), so the subset can be rebuilt and checked against its source.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from PIL import Image

CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
PER_CLASS = 100
OUT = Path(__file__).resolve().parents[1] / "src" / "vitscope" / "data" / "shipped" / "cifar10_test_1k.npz"


def main(root: str) -> None:
    images, labels, files = [], [], []
    for c, name in enumerate(CLASSES):
        chosen = sorted((Path(root) / name).glob("*.jpg"))[:PER_CLASS]
        if len(chosen) < PER_CLASS:
            raise SystemExit(f"{root}/{name} has {len(chosen)} images; need {PER_CLASS}")
        for f in chosen:
            with Image.open(f) as im:
                images.append(np.asarray(im.convert("RGB"), dtype=np.uint8))
            labels.append(c)
            files.append(f"{name}/{f.name}")
    np.savez_compressed(OUT, images=np.stack(images), labels=np.array(labels, dtype=np.int64),
                        classes=np.array(CLASSES), files=np.array(files))
    print(f"wrote {OUT} ({OUT.stat().st_size / 1e6:.2f} MB, {len(images)} images)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "../shared/data/cifar10/test")
