"""Draw a 2-D PCA projection of the probe's hidden states, coloured by label, into a PNG.

    python client_examples/probe/train_probe.py --save-features probe.npz   # rows + labels
    python client_examples/probe/plot_pca.py probe.npz probe_pca.png

No plotting library: points are drawn on a pixel canvas and written as PNG with zlib. The legend
is the printed mapping from label to colour.
"""

from __future__ import annotations

import argparse
import struct
import sys
import zlib

import numpy as np

COLOURS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
           (140, 86, 75), (227, 119, 194), (127, 127, 127)]


def pca_2d(rows: np.ndarray) -> np.ndarray:
    centred = rows - rows.mean(0)
    _, _, vt = np.linalg.svd(centred, full_matrices=False)
    return centred @ vt[:2].T


def write_png(path: str, pixels: np.ndarray) -> None:
    """pixels [height, width, 3] uint8 -> an RGB PNG."""
    h, w, _ = pixels.shape
    raw = b"".join(b"\x00" + pixels[y].tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    with open(path, "wb") as f:
        f.write(png)


def draw(points: np.ndarray, classes: np.ndarray, size: int = 600, radius: int = 3) -> np.ndarray:
    canvas = np.full((size, size, 3), 255, dtype=np.uint8)
    lo, hi = points.min(0), points.max(0)
    xy = (points - lo) / np.where(hi > lo, hi - lo, 1) * (size - 40) + 20
    for (x, y), c in zip(xy.astype(int), classes):
        y = size - 1 - y  # NOTE: image rows grow downwards
        canvas[max(0, y - radius) : y + radius + 1, max(0, x - radius) : x + radius + 1] = COLOURS[c % len(COLOURS)]
    return canvas


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("features", help=".npz from train_probe.py --save-features (rows, labels)")
    ap.add_argument("output", help="the PNG to write")
    args = ap.parse_args()
    data = np.load(args.features)
    rows, labels = data["rows"], data["labels"]
    names = sorted(set(labels.tolist()))
    classes = np.array([names.index(x) for x in labels])
    points = pca_2d(rows.astype(np.float64))
    write_png(args.output, draw(points, classes))
    for i, name in enumerate(names):
        print(f"{name}: rgb{COLOURS[i % len(COLOURS)]}")
    print(f"wrote {args.output} ({len(rows)} points)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
