#!/usr/bin/env bash
# Runs ON a lent GPU machine, from the repository's root, as one `device` call of at most 10 minutes
# (scripts/train-on-device.md gives the whole procedure). Every call ends with the run's weights as bf16
# shards in $OUT, because the machine, and everything on it, may be gone before the next call.
#
#   bash scripts/device-train.sh            unpack, train until BUDGET seconds after the call began (resuming the
#                                           run on a warm machine), then return shards 0-3, state.json, log.jsonl
#   bash scripts/device-train.sh collect K  return shards 4K..4K+3 of the last call (a model over ~60 MB)
#   bash scripts/device-train.sh upload     keep the corpus parts carried in .device-more/ on the machine for the
#                                           training call that follows (pack-device.sh says when one is needed)
#
#   CONFIG   training config (default configs/train/gpu-mini.yaml). One scheduled by `minutes` gets the minutes
#            the call has left once the corpus is tokenised, so its learning rate has decayed when the call ends.
#   BUDGET   seconds from the start of this script to the end of its training (default 530; the call's limit is 600)
#   MINUTES  for a config scheduled by steps: training minutes in this call (default 8), fewer where BUDGET
#            leaves fewer
#   DEVICE, PYTHON  cuda and python3 by default (a dry run here: DEVICE=cpu PYTHON=.venv/bin/python)
#   PACKED   the folder pack-device.sh filled (default .device; tests point it elsewhere)
#   RUN      the run's folder under WORK (default run): a second name on a warm machine trains a second candidate
#            from the same start, on the corpus the first call unpacked and tokenised
#   GPU_SAMPLE_S  seconds between samples of the GPU's utilisation and clocks while it trains (default 10)
#   PROFILE  steps A-B (as logged) profiled into profile.txt, sent back with the log (default 20-24; empty: none):
#            what the process feeding the GPU spends a step on (m31r/train/profile.py)
#
# The run starts from .device/shards (weights sent back by an earlier call) when present, else from the bundle in
# .device/init (an int8 copy of the release: half the bytes of the bf16 one), else from scratch.
set -euo pipefail
START=$(date +%s)
CONFIG=${CONFIG:-configs/train/gpu-mini.yaml}
BUDGET=${BUDGET:-530}
MINUTES=${MINUTES:-8}
DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python3}
W=${WORK:-/tmp/m31r-device}  # kept between calls while the machine stays warm
P=${PACKED:-.device}
R=$W/${RUN:-run}
OUT=${OUT:?OUT is set by the device tool}
# The tokeniser's own threads off: corpus tokenising runs a process per core (trainer.token_stream), and in training
# 12-14 forked row builders each with a thread per core would crowd out the one process that feeds the GPU (the
# twenty-ninth session's calls ran at half the earlier leases' tokens/s; the log's rows_wait_s and the line printed
# after training say which side was short).
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

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
if [ "${1:-train}" = upload ]; then
  mkdir -p "$W/more"
  cp "${MORE:-.device-more}"/train-*.jsonl.xz "$W/more/"
  ls -l "$W/more"
  exit 0
fi

# The trainer needs one package the image lacks (msgspec), carried as a wheel in .whl/.
if ! "$PY" -c "import msgspec" 2>/dev/null && [ ! -d /tmp/site ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
# Nor is this project installed there: the folders whose import packages have other names (pyproject's
# package-dir) are reached through links.
mkdir -p "$W/pkgs"
ln -sfn "$PWD/protocol" "$W/pkgs/m31r_protocol"
export PYTHONPATH=/tmp/site:$PWD:$W/pkgs
# A torch that cannot reach the device (a CPU-only build, no driver) stops the call here, in seconds: found by the
# trainer, it failed only after unpacking, tokenising and loading the corpus, and again in the retry without compile.
"$PY" - <<PY
import sys

import torch

try:
    torch.zeros(1, device="$DEVICE")
except Exception as e:
    sys.exit(f"torch {torch.__version__} cannot use the device $DEVICE ({str(e).splitlines()[0]}): nothing was "
             "unpacked or trained; run with a python whose torch can (PYTHON=)")
# So do a CONFIG that is missing or does not load with its model (a typo, a copy outside configs/train whose model:
# path is relative) and a BUDGET or MINUTES that is no number: they failed only after the corpus was unpacked and
# tokenised (a minute of the lease), in the retry without compile too.
import re

from m31r.train.trainer import load_train_config

for name, value in (("BUDGET", "$BUDGET"), ("MINUTES", "$MINUTES")):
    if not re.fullmatch(r"[0-9]+(\.[0-9]+)?", value):
        sys.exit(f"{name}={value!r} is not a number of {'seconds' if name == 'BUDGET' else 'minutes'}: nothing was "
                 "unpacked or trained")
try:
    from m31r.train.profile import parse_steps

    parse_steps("${PROFILE-20-24}")
except ValueError as e:
    sys.exit(f"PROFILE: {e}: nothing was unpacked or trained")
try:
    model_config = load_train_config("$CONFIG")[1]
except Exception as e:
    sys.exit(f"CONFIG=$CONFIG does not load ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}): "
             "nothing was unpacked or trained")
# The weights this call continues, checked here too: shards of two writes, one cut short on the way or a state.json
# of another run, and weights of another shape than CONFIG's model, failed only after the corpus was unpacked and
# tokenised (the latter in the retry without compile too, and then sent the same weights back).
from pathlib import Path

from m31r.train.shards import import_shards, read_state
from m31r.train.trainer import load_checkpoint, require_same_model

run_ckpt, shards = Path("$R/ckpt.pt"), Path("$P/shards")


def same_model(state: dict, where: Path, instead: str) -> None:
    try:
        require_same_model(state, model_config, where, "$CONFIG")
    except ValueError as e:  # (its advice, a new --run folder, is the trainer's)
        sys.exit(f"{str(e).split(': resume it')[0]}: nothing was unpacked or trained; {instead}")


try:
    if run_ckpt.is_file():  # a warm machine's run
        same_model(load_checkpoint(run_ckpt)["state"], run_ckpt, "train this config as another RUN=")
    elif shards.is_dir():  # a fresh machine: continue the weights sent back
        if (shards / "state.json").is_file():
            same_model(read_state(shards / "state.json"), shards, "train them with their own config, or pack "
                       "without them to start from the init")
        import_shards(shards, run_ckpt.parent)
except (ValueError, OSError) as e:
    sys.exit(f"{str(e).splitlines()[0]}: nothing was unpacked or trained")
PY

if [ ! -f "$W/data/corpus/train.jsonl" ]; then
  mkdir -p "$W/data/corpus"
  cp "$P/tokenizer.json" "$W/data/"
  cp "$P/manifest.json" "$W/data/corpus/"
  xz -dc -T0 "$P/val.jsonl.xz" > "$W/data/corpus/val.jsonl"
  parts=()  # the training corpus's parts in order, from this call's .device/ or an earlier upload call
  while read -r part; do
    if [ -f "$P/$part" ]; then parts+=("$P/$part")
    elif [ -f "$W/more/$part" ]; then parts+=("$W/more/$part")
    else echo "corpus part $part is missing: run the upload call (carry .device-more) first" >&2; exit 1
    fi
  done < "$P/parts.txt"
  xz -dc -T0 "${parts[@]}" > "$W/data/corpus/train.jsonl.part"
  mv "$W/data/corpus/train.jsonl.part" "$W/data/corpus/train.jsonl"
fi
INIT=  # (shards sent back earlier were imported into $R above)
if [ ! -f "$R/ckpt.pt" ] && [ -f "$P/init/model.safetensors" ]; then
  INIT=$P/init
fi
if [ "$DEVICE" != cpu ]; then  # || true: a field this driver does not know must not end the call
  nvidia-smi --query-gpu=name,memory.used,memory.total,mig.mode.current,clocks.max.sm,power.limit --format=csv || true
fi
"$PY" -c "from pathlib import Path; from m31r.train.trainer import corpus_tokens; print(corpus_tokens(Path('$W/data')))"

# What the GPU did while it trained: the fourth lease's calls ran at half the earlier leases' tokens/s, cause
# unknown. Its utilisation and clocks every 10 s are printed after training, with their medians (in train.out: $OUT
# already holds 7 of the 8 files a call may send back). Busy at low tokens/s means the GPU itself was slower (clocks,
# power, a slice of it); idle means the side feeding it was short.
SAMPLER=
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=timestamp,utilization.gpu,clocks.sm,clocks.max.sm,power.draw,temperature.gpu \
    --format=csv,noheader,nounits -l "${GPU_SAMPLE_S:-10}" > "$W/gpu.csv" 2>/dev/null &
  SAMPLER=$!
  trap 'kill "$SAMPLER" 2>/dev/null || true' EXIT
fi

trained=0
"$PY" - <<PY || trained=$?
import math, os, time, traceback
from pathlib import Path

import torch
import yaml

from m31r.train.profile import parse_steps
from m31r.train.trainer import train

config, run = Path("$CONFIG"), Path("$R")
profile = parse_steps("${PROFILE-20-24}")
deadline = $START + $BUDGET
init = "$INIT" or None
if init:  # the init bundle is mini's: a config of another shape starts from scratch instead
    from m31r.config import load_config
    from m31r.train.trainer import load_train_config

    want, have = load_train_config(config)[1], load_config(Path(init) / "config.yaml")
    if (want.n_layers, want.d_model, want.ffn_hidden, want.vocab_size) != (
            have.n_layers, have.d_model, have.ffn_hidden, have.vocab_size):
        print(f"not starting from {init}: {have.name} is not {want.name}'s shape; from scratch")
        init = None


def left() -> float:
    return (deadline - time.time()) / 60


def attempt(compile_: bool) -> dict:
    """Train with the config, its minutes set to what this call has left (on top of what the run has trained)."""
    spec = yaml.safe_load(config.read_text())
    stop = min($MINUTES, max(0.1, left() - 0.4))  # a config scheduled by steps: MINUTES, never past BUDGET
    if spec.get("minutes"):
        before = torch.load(run / "ckpt.pt", weights_only=False)["state"]["seconds"] if (run / "ckpt.pt").exists() else 0
        spec["minutes"] = round(before / 60 + max(0.1, left() - 0.4), 2)  # 0.4: loading, evaluations, checkpoints
        stop = max(left(), spec["minutes"] - before / 60 + 0.2)  # the wall-clock guard, never short of them
        print(f"this call trains {spec['minutes'] - before / 60:.2f} min (the schedule's minutes: {spec['minutes']})")
    spec["compile"] = compile_ and spec.get("compile", False)
    derived = config.with_name("device-run.yaml")
    derived.write_text(yaml.safe_dump(spec))
    return train(derived, "$W/data", run, max_minutes=stop, device="$DEVICE", init_from=init, profile=profile)


try:
    state = attempt(True)
except Exception:  # torch.compile is the part most likely to fail on an image not tried before: go on without it
    traceback.print_exc()
    if left() < 1:
        raise
    print("training again without torch.compile")
    state = attempt(False)
print(f"step {state['step']}, {state['tokens']:,} tokens, {state['seconds']:.0f} s of training, "
      f"{state['tokens'] / max(1e-9, state['seconds']):,.0f} tokens/s")
# Which side limits the run: steps blocked on the row builders, or the model (and the one process feeding it).
wait = sum(r.get("rows_wait_s", 0.0) for r in state["history"])
print(f"blocked on the row builders: {wait:.0f} s of the run's {state['seconds']:.0f} s; "
      f"load average {open('/proc/loadavg').read().split()[0]} on {os.cpu_count()} cores")
PY
if [ -n "$SAMPLER" ]; then
  kill "$SAMPLER" 2>/dev/null || true
  "$PY" - "$W/gpu.csv" <<'PY' || true
import statistics, sys

rows = [[f.strip() for f in line.split(",")] for line in open(sys.argv[1])]
rows = [r for r in rows if len(r) == 6 and r[1].isdigit()]
for r in rows:
    print("gpu sample:", ", ".join(r))
if rows:
    med = lambda i: statistics.median(float(r[i]) for r in rows)  # noqa: E731
    print(f"GPU while training: utilisation median {med(1):.0f}% ({len(rows)} samples), SM clock median "
          f"{med(2):.0f} of {med(3):.0f} MHz, power median {med(4):.0f} W, temperature median {med(5):.0f} C")
PY
fi
# Training that failed (an error after some checkpoints, the retry's too) still sends the run's last checkpoint back:
# the machine and the checkpoint are gone once the call ends.
if [ "$trained" -ne 0 ] && [ ! -f "$R/ckpt.pt" ]; then
  echo "training failed (status $trained) before its first checkpoint: no weights to send" >&2
  exit "$trained"
fi
rm -rf "$W/shards"
"$PY" -c "from pathlib import Path; from m31r.train.shards import write_shards; \
write_shards(Path('$R/ckpt.pt'), Path('$W/shards'))"
send_shards 0
if [ -f "$R/log.jsonl" ]; then cp "$R/log.jsonl" "$OUT/"; fi
if [ -f "$R/profile.txt" ]; then cp "$R/profile.txt" "$OUT/"; fi
echo "call: $(( $(date +%s) - START )) s"
if [ "$trained" -ne 0 ]; then
  echo "training failed (status $trained): sent the checkpoint of step $("$PY" -c "import json; \
print(json.load(open('$W/shards/state.json'))['step'])") instead" >&2
  exit "$trained"
fi
