#!/usr/bin/env bash
# Here, before a GPU session's first device call: pack what the trainer needs into .device/ and .whl/ (both
# ignored by git, both named in the call's `carry`). The working tree that travels is at most 64 MiB, so the
# corpus goes as xz, the starting weights as int8, and release/model.safetensors must be moved out of the tree
# for the calls (see scripts/train-on-device.md). Weights brought back earlier go along from .device/shards/ when present.
#
# The training corpus is compressed in parts. Those that do not fit beside the rest go to .device-more/, which
# an upload call carries to the machine first (`bash scripts/device-train.sh upload`, carry=[".device-more"]);
# the training call then finds them there. PART_MB (raw MB per part) and LIMIT_MIB (the travelling tree's
# ceiling, kept under the 64 MiB allowed) can be set.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-$HOME/.cache/m31r/data}
PART_MB=${PART_MB:-64}
LIMIT_MIB=${LIMIT_MIB:-60}
mkdir -p .device .whl
cp "$DATA/tokenizer.json" "$DATA/corpus/manifest.json" .device/
[ -f .device/val.jsonl.xz ] || xz -T0 -6 -c "$DATA/corpus/val.jsonl" > .device/val.jsonl.xz
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

# The training corpus in parts of whole lines, each its own xz stream (made again only when the corpus changed).
stamp=$(stat -c '%s %Y' "$DATA/corpus/train.jsonl")
if [ "$(cat .device/parts.stamp 2>/dev/null || true)" != "$stamp" ]; then
  rm -rf .device/train*.jsonl.xz .device-more /tmp/m31r-parts
  mkdir -p /tmp/m31r-parts
  split -d -a 2 -C "${PART_MB}M" --additional-suffix=.jsonl "$DATA/corpus/train.jsonl" /tmp/m31r-parts/train-
  for f in /tmp/m31r-parts/train-*.jsonl; do xz -T0 -9 "$f"; done
  mv /tmp/m31r-parts/train-*.jsonl.xz .device/
  rmdir /tmp/m31r-parts
  echo "$stamp" > .device/parts.stamp
fi
# Move trailing parts out to .device-more/ until the travelling tree fits.
shopt -s nullglob
tracked=$(git ls-files -z | grep -zv '^release/model.safetensors$' | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
size() { du -cb .device .whl | tail -1 | cut -f1; }
mkdir -p .device-more
for f in .device-more/train-*.jsonl.xz; do mv "$f" .device/; done
parts=(.device/train-*.jsonl.xz)
printf '%s\n' "${parts[@]##*/}" > .device/parts.txt
while [ $((tracked + $(size))) -gt $((LIMIT_MIB * 1024 * 1024)) ]; do
  here=(.device/train-*.jsonl.xz)
  [ "${#here[@]}" -gt 1 ] || { echo "the init and one corpus part are over ${LIMIT_MIB} MiB" >&2; exit 1; }
  mv "${here[-1]}" .device-more/
done
echo "training call: $(( (tracked + $(size)) / 1024 / 1024 )) MiB (code $((tracked / 1024 / 1024)) MiB, release weights left out)"
more=(.device-more/train-*.jsonl.xz)
if [ "${#more[@]}" -gt 0 ]; then
  echo "upload call first: $(( $(du -cb .device-more | tail -1 | cut -f1) / 1024 / 1024 )) MiB in .device-more (${more[*]##*/})"
else
  rmdir .device-more
fi
