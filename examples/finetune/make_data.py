#!/usr/bin/env python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""Builds the finetune example's default data from Debian's bible-kjv package: every verse of
Proverbs as a chat exchange ("Recite Proverbs 3:5 from the King James Bible." -> the verse), split
90/10 into train.jsonl and valid.jsonl (mlx-lm's layout), deterministically.

usage: make_data.py OUT_DIR   (needs the `bible` program: apt-get install bible-kjv)
"""
import json
import os
import random
import re
import subprocess
import sys

CHAPTERS = 31  # Proverbs


def verses():
    for ch in range(1, CHAPTERS + 1):
        out = subprocess.run(["bible", "-f", f"Prov {ch}:1-99"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            m = re.match(r"^Prv(\d+):(\d+)\s+(.*)$", line.strip())
            if m:
                yield int(m.group(1)), int(m.group(2)), m.group(3).strip()


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    rows = [{"prompt": f"Recite Proverbs {c}:{v} from the King James Bible.", "completion": text}
            for c, v, text in verses()]
    if len(rows) < 500:
        sys.exit(f"make_data.py: expected Proverbs' 915 verses, got {len(rows)} (is bible-kjv installed?)")
    random.Random(0).shuffle(rows)
    n_valid = len(rows) // 10
    for name, part in (("valid.jsonl", rows[:n_valid]), ("train.jsonl", rows[n_valid:])):
        with open(os.path.join(out_dir, name), "w") as f:
            for r in part:
                f.write(json.dumps(r) + "\n")
    print(f"{len(rows) - n_valid} train, {n_valid} valid examples in {out_dir}")


if __name__ == "__main__":
    main()
