#!/usr/bin/env python3
"""Renders the tracking scene: two faces (a crop of scikit-image's
astronaut photograph, public domain, at half size) moving on known paths
over a grey 320x240 background, one PNG per frame.

  face A: patch top-left (10 + 5 f, 10)          left to right, high
  face B: patch top-left (250 - 5 f, 65 + 2 f)   right to left, going down

Both patches stay whole inside the picture for 50 frames (f = 0 ... 49).

Usage: render_scene.py ASTRONAUT_PNG OUT_DIR FRAMES
Writes OUT_DIR/f000.png ... and prints nothing.
"""
import os
import sys

import numpy as np
from PIL import Image


def main():
    src, out, frames = sys.argv[1], sys.argv[2], int(sys.argv[3])
    face = Image.open(src).convert("RGB").crop((165, 40, 285, 190)).resize((60, 75))
    rng = np.random.default_rng(25)
    os.makedirs(out, exist_ok=True)
    for f in range(frames):
        bg = np.full((240, 320, 3), 128, np.int16) + rng.integers(-6, 7, size=(240, 320, 3))
        img = Image.fromarray(np.clip(bg, 0, 255).astype(np.uint8))
        img.paste(face, (10 + 5 * f, 10))
        img.paste(face, (250 - 5 * f, 65 + 2 * f))
        img.save(os.path.join(out, f"f{f:03d}.png"))


if __name__ == "__main__":
    main()
