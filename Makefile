# One entry point: `make run` (a completion from the bundled model, through the daemon) and `make test`.
# Every target installs what it needs into .venv first.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
TORCH_CPU_INDEX ?= $(if $(filter Linux,$(shell uname -s)),https://download.pytorch.org/whl/cpu)
DATA   ?= $(or $(M31R_DATA),$(HOME)/.cache/m31r/data)
RUN    ?= $(or $(M31R_RUN),$(HOME)/.cache/m31r/runs/mini)

.PHONY: install constraints run test test-python test-vscode vsix lint bench bench-ab soak bench-llamacpp bench-train train-data train export eval eval-large eval-exec clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch==2.13.0, pinned (an open range pulls gigabytes of CUDA wheels): a wheel this machine already has (pip's
	# find-links), else on Linux the CPU build from PyTorch's index (PyPI's Linux wheel is the CUDA one), else PyPI's.
	# Its dependencies come with the next line.
	$(BIN)/pip install -q --no-deps --no-index torch==2.13.0 2>/dev/null \
	  || $(if $(TORCH_CPU_INDEX),$(BIN)/pip install -q --no-deps --index-url $(TORCH_CPU_INDEX) torch==2.13.0 ||) \
	  $(BIN)/pip install -q --no-deps torch==2.13.0
	# constraints.txt: the versions the suite last passed with, so a fresh clone installs what was tested.
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# After upgrading a dependency in .venv (and a green `make test`), record the versions for the next fresh install.
constraints: install
	{ sed -n '1,2p' constraints.txt; $(BIN)/pip freeze --exclude-editable | sed -E 's/^(torch==[^+]*)\+.*/\1/'; } > constraints.txt.new
	cmp -s constraints.txt.new constraints.txt && rm constraints.txt.new || mv constraints.txt.new constraints.txt

run: install
	@echo "--- m31r fim: complete the body of a Rust function (the daemon starts in the background if needed)" >&2
	$(BIN)/m31r fim --file benchmarks/data/example.rs --line 5 --column 9 --max-tokens 48
	@echo >&2
	@echo "--- m31r generate" >&2
	$(BIN)/m31r generate "$$(printf 'pub fn is_power_of_two(n: u64) -> bool {\n    ')" --max-tokens 40
	@echo >&2
	@echo "(the daemon keeps running for the next request; \`$(BIN)/m31r stop\` ends it)" >&2

lint: install
	$(BIN)/ruff check .
	$(BIN)/python -m m31r_protocol.schema --check

test-python: install
	$(BIN)/python -m pytest -q -n auto

# The extension's node_modules: `npm ci` (which deletes and reinstalls them all) only when package.json or
# package-lock.json changed since the last install, preferring npm's cache to the network.
VSCODE := editors/vscode
NPM_STAMP := $(VSCODE)/node_modules/.m31r-installed
$(NPM_STAMP): $(VSCODE)/package.json $(VSCODE)/package-lock.json
	@command -v npm >/dev/null 2>&1 || { echo "npm is needed to build the VS Code extension" >&2; exit 1; }
	cd $(VSCODE) && npm ci --no-audit --no-fund --prefer-offline
	touch $@

test-vscode:
	@if command -v npm >/dev/null 2>&1; then \
		$(MAKE) --no-print-directory $(NPM_STAMP) && cd $(VSCODE) && npm test && npm run package; \
	else echo "npm not found: skipping the VS Code extension build" >&2; fi

# The VS Code extension package, built offline after `npm ci` with the @vscode/vsce that package-lock.json pins.
vsix: $(NPM_STAMP)
	cd $(VSCODE) && npm run package
	@echo "built editors/vscode/m31r.vsix: code --install-extension editors/vscode/m31r.vsix" >&2

test: lint test-vscode test-python

bench: install
	$(BIN)/python benchmarks/run_all.py

# Is this working tree slower than BASE? The same benchmark run alternately in BASE (a temporary git worktree) and
# here, ROUNDS times each (benchmarks/ab.py; README "Speed"). BASE defaults to HEAD~1: on main after a merge, the
# main before it; on a branch pass BASE=main. Writes bench-results/ab.json; fails on a regression beyond the noise.
BASE   ?= HEAD~1
ROUNDS ?= 5
bench-ab: install
	$(BIN)/python benchmarks/ab.py --base $(BASE) --rounds $(ROUNDS)

# Reliability figures (benchmarks/soak.py): the protocol fuzzer, vanishing clients, 100 concurrent clients, kill -9
# under the LSP server and the HTTP adapter; tiny model, loopback only, ~10-15 minutes on 2 cores. SOAK_SCALE=0.05
# is a quick run. Prints a table, writes bench-results/soak.json, fails if a target is missed.
SOAK_SCALE ?= 1
soak: install
	$(BIN)/python benchmarks/soak.py --scale $(SOAK_SCALE)

# M31R's decode beside llama.cpp's on the same weights (README "Speed"); not part of `make test`. The first run
# downloads llama-cpp-python's source from PyPI and builds llama.cpp's tools into $XDG_CACHE_HOME/m31r/llamacpp/.
bench-llamacpp: install
	$(BIN)/python benchmarks/bench_llamacpp.py --out bench-results/llamacpp.json

# Training the default model (see README "The default model"). DEBIAN caches the Debian packages and their
# unpacked sources; DATA holds the corpus, tokenizer and token streams; RUN the checkpoints. All outside the repo.
DEBIAN ?= $(or $(M31R_DEBIAN),$(HOME)/.cache/m31r/debian)
TRAIN  ?= configs/train/mini-phase6.yaml
DEVICE ?= cpu
BUNDLE ?= release

train-data: install
	$(BIN)/m31r train fetch --cache $(DEBIAN)
	$(BIN)/m31r train corpus $(DATA) --debian $(DEBIAN)
	$(BIN)/m31r train tokenizer $(DATA) --reuse release/tokenizer.json

# Resumes RUN's checkpoint; a new run starts from release/'s weights with a fresh optimizer.
train: install
	$(BIN)/m31r train model $(TRAIN) --data $(DATA) --run $(RUN) --init-from release --device $(DEVICE)

export: install
	$(BIN)/m31r train export --run $(RUN) --data $(DATA) --out release

eval: install
	$(BIN)/python benchmarks/eval_fim.py --bundle $(BUNDLE) --data $(DATA) --out bench-results/eval.json

# The tasks that decide a release since the thirtieth session (docs/training.md "Which tasks decide a release"): 300 single-line
# and 150 multi-line tasks of the same seed, three times `make eval`'s; about 2 minutes on 2 cores.
# EVAL_OUT names the JSON, so that two bundles' results can stand side by side for compare_evals.py.
EVAL_OUT ?= bench-results/eval-large.json
eval-large: install
	$(BIN)/python benchmarks/eval_fim.py --bundle $(BUNDLE) --data $(DATA) --n-single 300 --n-multi 150 --ppl-windows 4 \
		--out $(EVAL_OUT)

# Textbook functions completed by the model, compiled and tested with rustc (docs/training.md "Does the code run?").
eval-exec: install
	$(BIN)/python benchmarks/eval_exec.py --bundle $(BUNDLE) --out bench-results/exec.json

bench-train: install
	$(BIN)/python benchmarks/bench_train.py --config $(TRAIN) --data $(DATA) --out bench-results/train-speed.json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
