# Two commands: `make demo` (the main job on its embedded default) and `make test`.
# Both create or refresh the local virtualenv .venv first.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

# torch builds DeepSpeed's CPU communication op into $TORCH_EXTENSIONS_DIR (default: one directory per Python version
# under ~/.cache/torch_extensions, shared by every environment with that Python, each switch rebuilding the op with
# its lock held). This project's commands, and the launches its tests make, use the venv's own directory.
export TORCH_EXTENSIONS_DIR := $(CURDIR)/$(VENV)/torch_extensions

.PHONY: demo demo-peers bert-phase1 demo-digits demo-resnet demo-gpt test venv clean

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

# The main job on its embedded default (no download): BERT phase 2 from a LAMB phase-1 checkpoint past the loss
# plateau (built by bert-phase1 on the first run, reused after), on 2 CPU ranks: the tuned base optimizer and the same
# with K-FAC, then the steps and training seconds each needed to reach the base run's final held-out MLM loss
# (runs/demo/time_to_target.png marks that target).
TTT    := $(PY) benchmarks/time_to_target.py compare
PHASE1 := $(PY) examples/bert/phase1.py
BERT   := $(VENV)/bin/deepspeed --num_gpus 2 examples/bert/pretrain.py --output-dir runs/demo --cache-dir runs/bert-cache
bert-phase1: $(STAMP)
	$(PHASE1)

demo: $(STAMP)
	phase1=$$($(PHASE1)) && \
	$(BERT) --deepspeed_config configs/bert_cpu_phase2_base.json --init-checkpoint $$phase1 && \
	$(BERT) --deepspeed_config configs/bert_cpu_phase2_kfac.json --init-checkpoint $$phase1
	$(TTT) runs/demo/bert_cpu_phase2_base runs/demo/bert_cpu_phase2_kfac --metric held_out_mlm_loss

# The best tuned peer of the BERT demo (benchmarks/peers.py; docs/convergence.md has every peer's grid) from the same
# phase-1 checkpoint, then its time to target beside K-FAC's: the steps and seconds K-FAC needs to reach the peer's
# final held-out loss (after make demo, which trained the K-FAC run).
PEER := configs/bert_cpu_phase2_soap.json
demo-peers: $(STAMP)
	phase1=$$($(PHASE1)) && $(BERT) --deepspeed_config $(PEER) --init-checkpoint $$phase1
	test -f runs/demo/bert_cpu_phase2_kfac/metrics.csv || $(MAKE) demo
	$(TTT) runs/demo/$(basename $(notdir $(PEER))) runs/demo/bert_cpu_phase2_kfac --metric held_out_mlm_loss

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

# The linter first (ruff, configured in pyproject.toml); pytest exits 5 when it collects no test: that is a failure,
# never a silent success.
test: $(STAMP)
	$(VENV)/bin/ruff check ds_kfac tests examples benchmarks
	$(PY) -m pytest -q -p no:cacheprovider tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; fi; exit $$rc

clean:
	rm -rf $(VENV)
