# Two commands: `make demo` (the main job on its embedded default) and `make test`.
# Both create or refresh the local virtualenv .venv first.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo demo-digits demo-resnet test venv clean

venv: $(STAMP)

# torch first (the pinned CPU wheel), then DeepSpeed built against it without build isolation.
# DeepSpeed compiles its CPU shared-memory comm op on first use (minutes on 2 cores): the last
# python line builds it once here, so no training run or test launch pays for it.
$(STAMP): requirements-dev.txt setup.py
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $$(grep -E '^torch==' requirements-dev.txt)
	$(PY) -m pip install -q --no-build-isolation -r requirements-dev.txt
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	$(PY) -c "from deepspeed.accelerator import get_accelerator as a; b = a().create_op_builder('ShareMemCommBuilder'); b and b.load()"
	touch $(STAMP)

# The main job on its embedded default (no download): BERT phase-1 pretraining on 2 CPU ranks,
# LAMB and LAMB+K-FAC, compared in runs/demo/summary.txt and runs/demo/loss.png.
BERT := $(VENV)/bin/deepspeed --num_gpus 2 examples/bert/pretrain.py --output-dir runs/demo
demo: $(STAMP)
	$(BERT) --deepspeed_config configs/bert_cpu_phase1_lamb.json
	$(BERT) --deepspeed_config configs/bert_cpu_phase1_kfac.json

# The other examples: a CNN on scikit-learn's digits (standalone K-FAC) and ResNet with DeepSpeed.
demo-digits: $(STAMP)
	$(PY) examples/digits/train.py

demo-resnet: $(STAMP)
	$(VENV)/bin/deepspeed --num_gpus 2 examples/resnet/train.py --deepspeed_config configs/resnet_sgd_cpu.json
	$(VENV)/bin/deepspeed --num_gpus 2 examples/resnet/train.py --deepspeed_config configs/resnet_kfac_cpu.json

# pytest exits 5 when it collects no test: that is a failure, never a silent success.
test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; fi; exit $$rc

clean:
	rm -rf $(VENV)
