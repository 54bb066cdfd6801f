#!/usr/bin/env bash
# Runs ON a lent GPU machine, from the repository's root, as one `device` call of at most 10 minutes
# (scripts/train-on-device.md gives the whole procedure). Every call ends with the run's weights as bf16
# shards in $OUT, because the machine, and everything on it, may be gone before the next call.
#
#   bash scripts/device-train.sh            train for MINUTES (resuming the run on a warm machine), then
#                                           return shards 0-3, state.json and log.jsonl
#   bash scripts/device-train.sh collect K  return shards 4K..4K+3 of the last call (a model over ~60 MB)
#
#   CONFIG   training config (default configs/train/gpu-small.yaml)
#   MINUTES  training minutes in this call (default 8)
#   DEVICE, PYTHON  cuda and python3 by default (a dry run here: DEVICE=cpu PYTHON=.venv/bin/python)
set -euo pipefail
CONFIG=${CONFIG:-configs/train/gpu-small.yaml}
MINUTES=${MINUTES:-8}
DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python3}
W=${WORK:-/tmp/m31r-device}  # kept between calls while the machine stays warm
OUT=${OUT:?OUT is set by the device tool}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true

send_shards() {  # $1: which group of four shards
  local k=$1 i=0
  mkdir -p "$OUT/shards"
  for f in "$W"/shards/weights-*.safetensors; do
    if [ $((i / 4)) -eq "$k" ]; then cp "$f" "$OUT/shards/"; fi
    i=$((i + 1))
  done
  cp "$W/shards/state.json" "$OUT/shards/"
  echo "shards: $i in all; sent group $k"
}

if [ "${1:-train}" = collect ]; then
  send_shards "${2:?which group}"
  exit 0
fi

# The trainer needs one package the image lacks (msgspec), carried as a wheel in .whl/.
if ! "$PY" -c "import msgspec" 2>/dev/null && [ ! -d /tmp/site ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD

if [ ! -f "$W/data/corpus/train.jsonl" ]; then
  mkdir -p "$W/data/corpus"
  cp .device/tokenizer.json "$W/data/"
  cp .device/manifest.json "$W/data/corpus/"
  for s in train val; do xz -dc -T0 ".device/$s.jsonl.xz" > "$W/data/corpus/$s.jsonl"; done
fi
if [ ! -f "$W/run/ckpt.pt" ] && [ -d .device/shards ]; then  # a fresh machine: continue the weights sent back
  "$PY" -c "from pathlib import Path; from m31r.train.shards import import_shards; \
import_shards(Path('.device/shards'), Path('$W/run'))"
fi
if [ "$DEVICE" != cpu ]; then nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader; fi
"$PY" - <<PY
from m31r.train.trainer import train
state = train("$CONFIG", "$W/data", "$W/run", max_minutes=$MINUTES, device="$DEVICE")
print(f"step {state['step']}, {state['tokens']:,} tokens, {state['seconds']:.0f} s of training")
PY
rm -rf "$W/shards"
"$PY" -c "from pathlib import Path; from m31r.train.shards import write_shards; \
write_shards(Path('$W/run/ckpt.pt'), Path('$W/shards'))"
send_shards 0
cp "$W/run/log.jsonl" "$OUT/"
