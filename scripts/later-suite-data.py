"""Write a data folder holding only the training files a later Debian suite added to a corpus.

    python scripts/later-suite-data.py DATA OUT

DATA is a data folder whose corpus `m31r train corpus` built with a later suite (its manifest's
`train_only_roots`); OUT gets those files as its training split, DATA's validation split unchanged (the same
held-out crates) and DATA's tokenizer. A model that has been through the rest many times then trains on code
it has not seen (configs/train/mini-trixie.yaml).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path


def later_suite_data(data: Path, out: Path) -> dict:
    manifest = json.loads((data / "corpus" / "manifest.json").read_text())
    labels = tuple(f"{label}/" for label, _ in manifest.get("train_only_roots", []))
    if not labels:
        raise SystemExit(f"{data}'s corpus was built without a later suite (no train_only_roots in its manifest)")
    (out / "corpus").mkdir(parents=True, exist_ok=True)
    files = size = 0
    with (data / "corpus" / "train.jsonl").open(encoding="utf-8") as src, \
            (out / "corpus" / "train.jsonl").open("w", encoding="utf-8") as dst:
        for line in src:
            row = json.loads(line)
            if row["path"].startswith(labels):
                dst.write(line)
                files += 1
                size += len(row["text"].encode())
    shutil.copy(data / "corpus" / "val.jsonl", out / "corpus" / "val.jsonl")
    shutil.copy(data / "tokenizer.json", out / "tokenizer.json")
    manifest["splits"]["train"] = {"files": files, "bytes": size}
    manifest["subset"] = f"the training files of {', '.join(labels)} only"
    (out / "corpus" / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data", type=Path)
    p.add_argument("out", type=Path)
    args = p.parse_args()
    m = later_suite_data(args.data, args.out)
    print(f"{args.out}: {m['splits']['train']['files']:,} training files, {m['splits']['train']['bytes'] / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
