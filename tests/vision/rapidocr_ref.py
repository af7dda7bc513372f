#!/usr/bin/env python3
"""RapidOCR's own pipeline (rapidocr-onnxruntime, det -> cls -> rec) on
images: prints JSON {path: [text, ...]} in RapidOCR's order (top to bottom).
The reference the OCR tests and benchmark compare outpost with.

Usage: rapidocr_ref.py IMAGE...
"""
import json
import sys

try:
    from rapidocr_onnxruntime import RapidOCR
except ImportError:
    sys.exit("rapidocr_ref.py: rapidocr-onnxruntime is missing: "
             "python3 -m pip install -r models/requirements.txt")


def main():
    engine = RapidOCR()
    out = {}
    for p in sys.argv[1:]:
        result, _ = engine(p)
        out[p] = [r[1] for r in (result or [])]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
