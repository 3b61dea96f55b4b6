"""ds_kfac against DeepSpeed drift: ``initialize`` does what ``deepspeed.initialize`` does, the DeepSpeed
version is checked, a renamed ZeRO internal fails loudly, unsupported parallelism is refused (issue 14, item 12).

Engines are built in this process, on one gloo rank, as the deepspeed launcher would set it up.
"""

from __future__ import annotations

import argparse
import ast
import gc
import inspect
import json
import textwrap
import warnings
from pathlib import Path
from typing import Any

import deepspeed
import pytest
import torch
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.pipe.dualpipev import DualPipeVModule
from deepspeed.runtime.torch_autocast import is_autocast_initialized
from packaging.requirements import Requirement
from workers import problem

import ds_kfac
from ds_kfac.integration import initialize as initialize_module
from ds_kfac.integration.layouts import Zero12Gradients
from ds_kfac.integration.pipeline import KFACPipelineEngine

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
BASE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}

FOLLOWED = "called by ds_kfac.initialize's K-FAC path too"
DEEPSPEED_INITIALIZE_CALLS = {
    "log_dist": FOLLOWED,
    "shutdown_init_context": FOLLOWED,
    "init_distributed": FOLLOWED,
    "get_accelerator": FOLLOWED,
    "communication_backend_name": FOLLOWED,
    "load_ds_config": FOLLOWED,
    "warning": FOLLOWED,  # the deprecated --deepscale_config
    "merge_tp_model_init_into_config": FOLLOWED,
    "set_autotp_mode": FOLLOWED,
    "DeepSpeedConfig": FOLLOWED,
    "set_optimizer_flags": FOLLOWED,
    "restore_init_context": FOLLOWED,
    "_configure_python_gc": FOLLOWED,
    "DeepSpeedEngine": "replaced by its subclass KFACEngine",
    "DeepSpeedHybridEngine": "refused: hybrid_engine.enabled",
    "initialize_mesh_device": "refused: mesh_param / sequence_parallel_size",
    "info": "logs of the refused mesh branch",
    "engine_cls": "replaced by KFACPipelineEngine, the PipelineEngine subclass (DualPipeVModule: refused)",
    "mpu": FOLLOWED,  # the pipeline branch's model.mpu()
    "format": "plumbing (the version log line)",
    "get": "plumbing (dict.get)",
    "hasattr": "plumbing",
    "isinstance": "plumbing",
    "tuple": "plumbing",
}
"""Every function ``deepspeed.initialize`` calls, and what ds_kfac does about it."""


def _called_names(source: str) -> set[str]:
    """The names of the functions called in ``source`` (the last attribute of ``a.b.f(...)``)."""
    names = set()
    for node in ast.walk(ast.parse(textwrap.dedent(source))):
        if isinstance(node, ast.Call):
            func = node.func
            names.add(func.id if isinstance(func, ast.Name) else getattr(func, "attr", ast.dump(func)))
    return names


def test_every_step_of_deepspeed_initialize_is_followed() -> None:
    """Issue 14, item 12 (a): a call DeepSpeed adds to (or drops from) ``deepspeed.initialize`` fails this test
    until it is followed (or refused) in ds_kfac/integration/initialize.py and listed above."""
    called = _called_names(inspect.getsource(deepspeed.initialize))
    assert called == set(DEEPSPEED_INITIALIZE_CALLS), (
        f"deepspeed.initialize now also calls {sorted(called - set(DEEPSPEED_INITIALIZE_CALLS))} and no longer "
        f"{sorted(set(DEEPSPEED_INITIALIZE_CALLS) - called)}: follow it in ds_kfac.initialize"
    )
    ours = _called_names(inspect.getsource(initialize_module))
    followed = {name for name, what in DEEPSPEED_INITIALIZE_CALLS.items() if what == FOLLOWED}
    assert followed <= ours, f"ds_kfac.initialize does not call {sorted(followed - ours)}"


def _pipeline_model(cls: type[PipelineModule] = PipelineModule) -> PipelineModule:
    """The problem's model as a one-stage pipeline (the process group must exist first, as for any pipeline)."""
    deepspeed.init_distributed(dist_backend="gloo")
    return cls(layers=list(problem.make_model()), num_stages=1, loss_fn=problem.loss_fn)


def _effects(init: Any, config: dict, tmp_path: Path, pipeline: bool = False) -> dict[str, Any]:
    """What one ``initialize`` leaves behind, with the config given as a deprecated ``--deepscale_config``
    file and ``args.local_rank`` unset: Python's GC, Muon's parameter flags, ``args.local_rank``, the engine's
    mpu (for a ``pipeline``, the model's grid)."""
    path = tmp_path / f"{init.__module__}.json"
    path.write_text(json.dumps(config))
    args = argparse.Namespace(deepscale_config=str(path), local_rank=None)
    model = _pipeline_model() if pipeline else problem.make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)  # the client optimizer; the JSON names Muon
    engine, *_ = init(args=args, model=model, optimizer=sgd)
    effects = {
        "gc_enabled": gc.isenabled(),
        "use_muon": [getattr(p, "use_muon", None) for p in model.parameters()],
        "local_rank": args.local_rank,
        "mpu_is_grid": engine.mpu is getattr(model, "_grid", False),
    }
    engine.destroy()
    return effects


@pytest.mark.parametrize("pipeline", [False, True], ids=["engine", "pipeline"])
def test_initialize_has_the_effects_of_deepspeed_initialize(engines: list[Any], tmp_path: Path, pipeline: bool) -> None:
    """Issue 14, item 12 (a): the K-FAC path honours ``disable_python_gc``, sets the optimizer flags
    ``set_optimizer_flags`` sets (Muon's ``use_muon``), reads ``--deepscale_config`` and aligns
    ``args.local_rank``, exactly as ``deepspeed.initialize`` does; for a ``PipelineModule`` (issue 11) its
    pipeline branch too, whose engine's mpu is the model's grid."""
    config = {**BASE, "optimizer": {"type": "Muon", "params": {"lr": 0.01}}, "disable_python_gc": True}
    assert gc.isenabled()
    ours = _effects(ds_kfac.initialize, {**config, "kfac": {}}, tmp_path, pipeline)
    assert gc.isenabled()  # engine.destroy() gave it back
    theirs = _effects(deepspeed.initialize, config, tmp_path, pipeline)
    expected = {"gc_enabled": False, "use_muon": [True, False] * 3, "local_rank": 0, "mpu_is_grid": pipeline}
    assert theirs == expected  # not vacuous
    assert ours == theirs


def test_unverified_deepspeed_version_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 14, item 12 (b): a DeepSpeed outside the verified range is named, with the range, in one
    warning per process; the verified version (also with a local build tag) gives none."""
    model = problem.make_model()
    bad_section = {**BASE, "kfac": {"dampnig": 0.1}}  # initialize stops at validation: no engine needed

    def warnings_of(version: str) -> list[str]:
        monkeypatch.setattr(deepspeed, "__version__", version)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                with pytest.raises(ds_kfac.KFACConfigError):
                    ds_kfac.initialize(model=model, config=bad_section)
        return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]

    for version in ("0.20.0", "0.19.7"):
        (message,) = warnings_of(version)
        assert f"DeepSpeed {version} is outside the range ds_kfac was verified on (deepspeed==0.19.8)" in message
        assert "docs/maintainers.md" in message
    assert warnings_of("0.19.8") == [] and warnings_of("0.19.8+cpu") == []


def test_setup_requires_the_verified_deepspeed() -> None:
    """Issue 14, item 12 (b): setup.py's ``deepspeed`` extra is the range the version check accepts."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    extras = next(k.value for k in ast.walk(tree) if isinstance(k, ast.keyword) and k.arg == "extras_require")
    (requirement,) = (Requirement(r) for r in ast.literal_eval(extras)["deepspeed"])
    assert requirement.name == "deepspeed"
    assert requirement.specifier == initialize_module.VERIFIED_DEEPSPEED
    assert deepspeed.__version__ in requirement.specifier  # the installed one is the verified one


def _zero2_engine(engines: list[Any]) -> Any:
    model = problem.make_model()
    config = {**BASE, "zero_optimization": {"stage": 2}, "gradient_clipping": 0.0, "kfac": {}}
    engine, *_ = ds_kfac.initialize(model=model, model_parameters=problem.param_groups(model), config=config)
    engines.append(engine)
    return engine


def _train_step(engine: Any) -> None:
    x, y = problem.global_batch(0, 2)
    engine.backward(problem.loss_fn(engine(x), y))
    engine.step()


def test_renamed_zero_internal_raises_naming_the_layers(engines: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 14, item 12 (c): under ZeRO 2, a DeepSpeed that no longer exposes ``param._hp_mapping`` (simulated:
    the fragment lookup finds nothing) makes the first step with decompositions raise, naming every layer and
    docs/maintainers.md, before DeepSpeed applies the unpreconditioned gradients. The real lookup passes."""
    engine = _zero2_engine(engines)
    _train_step(engine)
    assert engine.kfac.preconditioned == ("0", "2", "4")
    monkeypatch.setattr(Zero12Gradients, "fragment", lambda self, param: None)
    engine = _zero2_engine(engines)
    before = [p.detach().clone() for p in engine.module.parameters()]
    with pytest.raises(RuntimeError, match=r"K-FAC layers \['0', '2', '4'\] have decompositions") as error:
        _train_step(engine)
    assert "param._hp_mapping" in str(error.value) and "docs/maintainers.md" in str(error.value)
    assert all(torch.equal(b, p) for b, p in zip(before, engine.module.parameters()))


REFUSED = {
    "mpu": ({}, {"mpu": object()}, "model parallelism through mpu=object (supported: megatron.core.parallel_state)"),
    "autotp": ({"tensor_parallel": {"autotp_size": 2}}, {}, "tensor_parallel.autotp_size=2 (AutoTP"),
    "hybrid engine": ({"hybrid_engine": {"enabled": True}}, {}, "hybrid_engine.enabled=true (DeepSpeedHybridEngine"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_tensor_parallelism_and_hybrid_engine_refused(case: str, engines: list[Any]) -> None:
    """Issue 14, item 12 (d): tensor parallelism other than Megatron's (another ``mpu``, AutoTP) and the hybrid
    engine are refused at ``initialize``, in the message that names every unsupported part of the setup (Megatron's
    refusals: ``tests/test_tensor_parallel.py``)."""
    section, kwargs, message = REFUSED[case]
    model = problem.make_model()
    with pytest.raises(ds_kfac.KFACConfigError, match="K-FAC does not support yet: ") as error:
        ds_kfac.initialize(
            model=model, model_parameters=model.parameters(), config={**BASE, **section, "kfac": {}}, **kwargs
        )
    assert message in str(error.value)


@pytest.mark.parametrize("kfac", [{}, {"eigenbasis_moments": True}], ids=["kfac", "eigenbasis_moments"])
def test_torch_autocast_refused_naming_the_section(kfac: dict, engines: list[Any]) -> None:
    """Issue 47, item 4: DeepSpeed's ``"torch_autocast"`` section enabled with K-FAC is refused at ``initialize``,
    naming the section and why, before the engine marks autocast initialized (a process-wide flag); disabled, or
    without the section, the engine is built."""
    model = problem.make_model()
    optimizer = {"type": "AdamW", "params": {"lr": 0.01}} if kfac else BASE["optimizer"]
    config = {**BASE, "optimizer": optimizer, "kfac": kfac}
    with pytest.raises(ds_kfac.KFACConfigError, match="K-FAC does not support yet: ") as error:
        ds_kfac.initialize(
            model=model, model_parameters=model.parameters(), config={**config, "torch_autocast": {"enabled": True}}
        )
    assert "torch_autocast.enabled=true (K-FAC's hooks would collect A and G in the autocast dtype" in str(error.value)
    assert not is_autocast_initialized()
    for section in ({"torch_autocast": {"enabled": False}}, {}):
        engine, *_ = ds_kfac.initialize(model=model, model_parameters=model.parameters(), config={**config, **section})
        engines.append(engine)
        assert not engine.torch_autocast_enabled()


PIPELINE_REFUSED = {
    "zero2": ({"zero_optimization": {"stage": 2}}, {}, "zero_optimization.stage=2 with pipeline parallelism"),
    "bf16 zero0": ({"bf16": {"enabled": True}}, {}, "bf16 at ZeRO stage 0 with pipeline parallelism"),
    "fp16": ({"fp16": {"enabled": True}, "zero_optimization": {"stage": 1}}, {}, "fp16 with pipeline parallelism"),
    "mpu": ({}, {"mpu": object()}, "mpu=object with a PipelineModule"),
    "dualpipev": ({}, {"cls": DualPipeVModule}, "DualPipeV pipelines (DualPipeVModule"),
    "sampled fisher": ({"kfac": {"fisher": "sampled"}}, {}, 'kfac.fisher="sampled" with pipeline parallelism'),
}


@pytest.mark.parametrize("case", list(PIPELINE_REFUSED))
def test_pipeline_setups_k_fac_does_not_support_are_refused(case: str, engines: list[Any]) -> None:
    """Issue 11, item 3: with a ``PipelineModule``, ZeRO >= 2 (which DeepSpeed's pipeline refuses too), fp16,
    bf16 at ZeRO 0 (DeepSpeed's BF16_Optimizer), a user's mpu and DualPipeV are refused at ``initialize``, naming what is wrong; plain fp32 at
    ZeRO 0 builds a :class:`KFACPipelineEngine`. Issue 22: so is the sampled Fisher, whose call the loss computed inside
    ``train_batch()`` leaves no place for."""
    section, kwargs, message = PIPELINE_REFUSED[case]
    model = _pipeline_model(kwargs.pop("cls", PipelineModule))
    with pytest.raises(ds_kfac.KFACConfigError, match="K-FAC does not support yet: ") as error:
        ds_kfac.initialize(model=model, config={**BASE, "kfac": {}, **section}, **kwargs)
    assert message in str(error.value)
    engine, *_ = ds_kfac.initialize(model=_pipeline_model(), config={**BASE, "kfac": {}})
    engines.append(engine)
    assert isinstance(engine, KFACPipelineEngine)


def test_pipeline_with_a_model_axis_is_refused(engines: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 11: a pipeline topology with a model (tensor-slicing) axis is refused (simulated on one rank: the
    grid reports 2 slices), naming its size."""
    model = _pipeline_model()
    monkeypatch.setattr(model._grid, "slice_parallel_size", 2)
    with pytest.raises(ds_kfac.KFACConfigError, match="a pipeline topology with a model axis of size 2"):
        ds_kfac.initialize(model=model, config={**BASE, "kfac": {}})
