#!/usr/bin/env python3
"""Renders text images with known strings for the OCR tests and benchmark:
several fonts (Pillow's own, DejaVu Sans, Serif Bold and Sans Mono from
Debian's fonts-dejavu-core) and sizes, slight rotations, and one image
whose second line is upside down. Writes OUT/<name>.png and OUT/truth.json
({name: [line, ...]}, lines top to bottom).

Usage: render_text.py OUT
"""
import json
import os
import sys

from PIL import Image, ImageDraw, ImageFont

DEJAVU = "/usr/share/fonts/truetype/dejavu"
FONTS = {
    "pillow": None,
    "sans": f"{DEJAVU}/DejaVuSans.ttf",
    "serif_bold": f"{DEJAVU}/DejaVuSerif-Bold.ttf",
    "mono": f"{DEJAVU}/DejaVuSansMono.ttf",
}
PAPER = (236, 233, 226)
INK = (20, 20, 30)

# (name, font, size, rotation in degrees, lines, index of an upside-down line)
PAGES = [
    ("report", "pillow", 36, 0.0,
     ["OUTPOST FIELD REPORT", "pump 3 temperature 81 C", "valve closed at 06:40"], None),
    ("crate", "sans", 30, 1.5, ["CRATE 0417", "Harbour gate B", "weight 1250 kg"], None),
    ("label", "serif_bold", 40, -2.0, ["LOT 7731", "Best before 2027"], None),
    ("meter", "mono", 26, 0.0, ["METER ID 55-210", "reading 004182", "line 3 north"], None),
    ("small", "sans", 22, 1.0, ["Pressure 4.2 bar", "Flow 310 litres"], None),
    ("flipped", "sans", 34, 0.0, ["SHIP TO DOCK 9", "FRAGILE GLASS"], 1),
]


def font(name, size):
    path = FONTS[name]
    if path is None:
        return ImageFont.load_default(size)
    if not os.path.exists(path):
        sys.exit(f"render_text.py: {path} is missing: install Debian's fonts-dejavu-core")
    return ImageFont.truetype(path, size)


def line_image(text, f):
    l, t, r, b = f.getbbox(text)
    img = Image.new("RGB", (r - l + 16, b - t + 16), PAPER)
    ImageDraw.Draw(img).text((8 - l, 8 - t), text, fill=INK, font=f)
    return img


def page(lines, f, angle, flipped):
    parts = [line_image(t, f) for t in lines]
    if flipped is not None:
        parts[flipped] = parts[flipped].rotate(180)
    w = max(p.width for p in parts) + 80
    gap = parts[0].height
    h = sum(p.height for p in parts) + gap * (len(parts) + 1)
    img = Image.new("RGB", (w, h), PAPER)
    y = gap
    for p in parts:
        img.paste(p, (40, y))
        y += p.height + gap
    if angle:
        img = img.rotate(angle, resample=Image.BICUBIC, expand=True, fillcolor=PAPER)
    return img


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    truth = {}
    for name, fname, size, angle, lines, flipped in PAGES:
        page(lines, font(fname, size), angle, flipped).save(os.path.join(out, f"{name}.png"))
        truth[name] = lines
    with open(os.path.join(out, "truth.json"), "w") as f:
        json.dump(truth, f, indent=1)


if __name__ == "__main__":
    main()
