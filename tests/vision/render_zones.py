#!/usr/bin/env python3
"""Renders the zone analytics scene: two faces (the crop of scikit-image's
astronaut photograph that render_scene.py uses, public domain, 60x75) on
known straight paths over a grey 320x240 background, one PNG per frame.

  face A: patch top-left (100 + 3 f, f)    right and down, high in the picture
  face B: patch top-left (5 + 4 f, 150)    left to right along the bottom

Both patches stay whole inside the picture and never overlap for 50
frames (f = 0 ... 49). tests/it/zone_analytics.rs places its zones, lines
and calibration against these paths.

Usage: render_zones.py ASTRONAUT_PNG OUT_DIR FRAMES
Writes OUT_DIR/f000.png ... and prints nothing.
"""
import os
import sys

import numpy as np
from PIL import Image


def main():
    src, out, frames = sys.argv[1], sys.argv[2], int(sys.argv[3])
    face = Image.open(src).convert("RGB").crop((165, 40, 285, 190)).resize((60, 75))
    rng = np.random.default_rng(44)
    os.makedirs(out, exist_ok=True)
    for f in range(frames):
        bg = np.full((240, 320, 3), 128, np.int16) + rng.integers(-6, 7, size=(240, 320, 3))
        img = Image.fromarray(np.clip(bg, 0, 255).astype(np.uint8))
        img.paste(face, (100 + 3 * f, f))
        img.paste(face, (5 + 4 * f, 150))
        img.save(os.path.join(out, f"f{f:03d}.png"))


if __name__ == "__main__":
    main()
