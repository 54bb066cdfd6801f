#!/usr/bin/env bash
# Here, before a GPU session's first device call: pack what the trainer needs into .device/ and .whl/ (both
# ignored by git, both named in the call's `carry`). The working tree that travels is at most 64 MiB, so the
# corpus goes as xz, the starting weights as int8, and release/model.safetensors must be moved out of the tree
# for the calls (see scripts/train-on-device.md). Weights brought back earlier go along from .device/shards/ when present.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-$HOME/.cache/m31r/data}
mkdir -p .device .whl
for s in train val; do
  [ -f ".device/$s.jsonl.xz" ] || xz -T0 -6 -c "$DATA/corpus/$s.jsonl" > ".device/$s.jsonl.xz"
done
cp "$DATA/tokenizer.json" "$DATA/corpus/manifest.json" .device/
# The run's start: an int8 copy of the release (29 MB), since the bf16 one (59 MB) and the corpus are over 64 MiB.
rm -rf .device/init  # made again each time: release/ may have changed since
if [ ! -d .device/shards ]; then
  .venv/bin/m31r bundle quantize --quant int8 release .device/init
fi
# The device's Python is 3.12 on x86-64 (the device tool's KINDS.md); msgspec is the one package missing there.
version=$(.venv/bin/python -c 'import msgspec; print(msgspec.__version__)')
rm -f .whl/msgspec-*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "msgspec==$version"
du -ch .device .whl | tail -1
tracked=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
echo "tracked files: $((tracked / 1024 / 1024)) MiB (release/model.safetensors included; move it out for the call)"
