#!/usr/bin/env bash
# Here, before a GPU session's first device call: pack what the trainer needs into .device/ and .whl/ (both
# ignored by git, both named in the call's `carry`). The working tree that travels is at most 64 MiB, so the
# corpus goes as xz, the starting weights as int8, and release/model.safetensors must be moved out of the tree
# for the calls (see scripts/train-on-device.md). Weights brought back earlier go along from .device/shards/ when present.
#
# The training corpus is compressed in parts. Those that do not fit beside the rest go to .device-more/, which
# an upload call carries to the machine first (`bash scripts/device-train.sh upload`, carry=[".device-more"]);
# the training call then finds them there.
#   PART    raw size of a part, as split(1) reads it (default 64M)
#   LIMIT   the travelling tree's ceiling, as numfmt --from=iec reads it (default 60M, under the 64 MiB allowed)
#   DATA    the data folder `make train-data` filled (default ~/.cache/m31r/data)
#   DEST    where .device/, .device-more/ and .whl/ are made (default the repository; tests point it elsewhere)
#   RELEASE, M31R, PY  the bundle to start from, and this project's m31r and python (default release/, .venv/bin/)
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-$HOME/.cache/m31r/data}
PART=${PART:-64M}
LIMIT=$(numfmt --from=iec "${LIMIT:-60M}")
DEST=${DEST:-.}
RELEASE=${RELEASE:-release}
M31R=${M31R:-.venv/bin/m31r}
PY=${PY:-.venv/bin/python}
D=$DEST/.device MORE=$DEST/.device-more WHL=$DEST/.whl
if [ -d "$D/shards" ]; then  # weights of an earlier call: checked here (two writes mixed, one cut short), not on a lease
  "$PY" - "$D/shards" <<'PY'
import sys
from pathlib import Path

from m31r.train.shards import read_shards

try:
    state = read_shards(Path(sys.argv[1]))[1]
except (ValueError, OSError) as e:
    sys.exit(f"{str(e).splitlines()[0]}: nothing was packed")
print(f"{sys.argv[1]}: the run's start, step {state['step']} of {state['model_config'].get('name')}")
PY
fi
mkdir -p "$D" "$WHL"
cp "$DATA/tokenizer.json" "$DATA/corpus/manifest.json" "$D/"
# Each .xz is written under a temporary name and renamed when whole (an interrupted pack leaves no truncated one),
# and made again when its file changed (size, time to the nanosecond), as when the corpus is built again.
stamp() { stat -c '%s %.9Y' "$1"; }
val_stamp="$(stamp "$DATA/corpus/val.jsonl")"
if [ ! -f "$D/val.jsonl.xz" ] || [ "$(cat "$D/val.stamp" 2>/dev/null || true)" != "$val_stamp" ]; then
  rm -f "$D/val.stamp"
  xz -T0 -6 -c "$DATA/corpus/val.jsonl" > "$D/val.jsonl.xz.tmp"
  mv "$D/val.jsonl.xz.tmp" "$D/val.jsonl.xz"
  echo "$val_stamp" > "$D/val.stamp"
fi
# The run's start: an int8 copy of the release (29 MB), since the bf16 one (59 MB) and the corpus are over 64 MiB.
rm -rf "$D/init"  # made again each time: release/ may have changed since
if [ ! -d "$D/shards" ]; then
  "$M31R" bundle quantize --quant int8 "$RELEASE" "$D/init"
fi
# The device's Python is 3.12 on x86-64 (the device tool's KINDS.md); msgspec is the one package missing there.
# Downloaded only when the wheel of this project's version is not there yet.
version=$("$PY" -c 'import msgspec; print(msgspec.__version__)')
if ! compgen -G "$WHL/msgspec-$version-*.whl" >/dev/null; then
  rm -f "$WHL"/msgspec-*.whl
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$WHL" "msgspec==$version"
fi

# The training corpus in parts of whole lines, each its own xz stream (made again only when the corpus changed).
parts_stamp="$(stamp "$DATA/corpus/train.jsonl") $PART"
if [ "$(cat "$D/parts.stamp" 2>/dev/null || true)" != "$parts_stamp" ]; then
  rm -rf "$D"/train-*.jsonl.xz "$MORE" "$D/parts.stamp" "$D"/.parts.*
  tmp=$(mktemp -d "$D/.parts.XXXXXX")  # beside the parts: each mv below is a rename
  split -d -a 2 -C "$PART" --additional-suffix=.jsonl "$DATA/corpus/train.jsonl" "$tmp/train-"
  for f in "$tmp"/train-*.jsonl; do xz -T0 -9 "$f"; done
  mv "$tmp"/train-*.jsonl.xz "$D/"
  rmdir "$tmp"
  echo "$parts_stamp" > "$D/parts.stamp"
fi
# Move trailing parts out to .device-more/ until the travelling tree fits.
shopt -s nullglob
# What the device tool sends beside the carried folders: tracked files and untracked ones git does not ignore, as
# they are in the working tree (a tracked file deleted there travels as nothing; du stopped the pack on it).
tracked=$(git ls-files -z --cached --others --exclude-standard | grep -zv '^release/model.safetensors$' |
  while IFS= read -r -d '' f; do if [ -f "$f" ]; then printf '%s\0' "$f"; fi; done |
  du -cb --files0-from=- | tail -1 | cut -f1)
size() { find "$D" "$WHL" -type f -printf '%s\n' | awk '{ s += $1 } END { print s + 0 }'; }  # file bytes
mkdir -p "$MORE"
for f in "$MORE"/train-*.jsonl.xz; do mv "$f" "$D/"; done
parts=("$D"/train-*.jsonl.xz)
printf '%s\n' "${parts[@]##*/}" > "$D/parts.txt"
while [ $((tracked + $(size))) -gt "$LIMIT" ]; do
  here=("$D"/train-*.jsonl.xz)
  [ "${#here[@]}" -gt 1 ] || { echo "the init and one corpus part are over $(numfmt --to=iec "$LIMIT")" >&2; exit 1; }
  mv "${here[-1]}" "$MORE/"
done
echo "training call: $(( (tracked + $(size)) / 1024 / 1024 )) MiB (code $((tracked / 1024 / 1024)) MiB, release weights left out)"
more=("$MORE"/train-*.jsonl.xz)
if [ "${#more[@]}" -gt 0 ]; then
  echo "upload call first: $(( $(du -cb "$MORE" | tail -1 | cut -f1) / 1024 / 1024 )) MiB in .device-more (${more[*]##*/})"
else
  rmdir "$MORE"
fi
