# Two commands: `make demo` (the main job on its embedded default) and `make test`.
# Both create or refresh the local virtualenv .venv first.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo demo-digits demo-resnet demo-gpt test venv clean

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
# LAMB and LAMB+K-FAC, then the steps and training seconds each needed to reach the LAMB run's
# final held-out MLM loss (runs/demo/time_to_target.png marks that target).
TTT  := $(PY) benchmarks/time_to_target.py compare
BERT := $(VENV)/bin/deepspeed --num_gpus 2 examples/bert/pretrain.py --output-dir runs/demo
demo: $(STAMP)
	$(BERT) --deepspeed_config configs/bert_cpu_phase1_lamb.json
	$(BERT) --deepspeed_config configs/bert_cpu_phase1_kfac.json
	$(TTT) runs/demo/bert_cpu_phase1_lamb runs/demo/bert_cpu_phase1_kfac --metric held_out_mlm_loss

# The other examples: a CNN on scikit-learn's digits (standalone K-FAC) and ResNet with DeepSpeed
# (SGD and SGD+K-FAC, compared on held-out accuracy as the BERT demo is on held-out loss).
RESNET := $(VENV)/bin/deepspeed --num_gpus 2 examples/resnet/train.py --output-dir runs/demo-resnet
demo-digits: $(STAMP)
	$(PY) examples/digits/train.py

demo-resnet: $(STAMP)
	$(RESNET) --deepspeed_config configs/resnet_sgd_cpu.json
	$(RESNET) --deepspeed_config configs/resnet_kfac_cpu.json
	$(TTT) runs/demo-resnet/resnet_sgd_cpu runs/demo-resnet/resnet_kfac_cpu --metric held_out_accuracy --higher-is-better

# A small GPT from megatron-core layers on 4 CPU ranks, tensor-parallel 2 inside each of 2 pipeline stages
# (examples/gpt): LAMB and LAMB+K-FAC, compared on held-out next-token loss.
GPT := $(VENV)/bin/deepspeed --num_gpus 4 examples/gpt/train.py --tp 2 --pp 2 --output-dir runs/demo-gpt
demo-gpt: $(STAMP)
	$(GPT) --deepspeed_config configs/gpt_cpu.json
	$(GPT) --deepspeed_config configs/gpt_kfac_cpu.json
	$(TTT) runs/demo-gpt/gpt_cpu runs/demo-gpt/gpt_kfac_cpu --metric held_out_loss

# pytest exits 5 when it collects no test: that is a failure, never a silent success.
test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; fi; exit $$rc

clean:
	rm -rf $(VENV)
