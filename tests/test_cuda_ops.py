"""``TORCH_CUDA_ARCH_LIST`` for DeepSpeed's FusedLamb build (ds_kfac/integration/cuda_ops.py): DeepSpeed 0.19.8's
builder fails on ``9.0a`` (issue 45), so the visible devices' capabilities are built for, and the user's variable is
restored; every other failure still falls back to ds_kfac's Lamb with its message. A stand-in FusedLamb fails the
way DeepSpeed's builder does."""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import pytest
import torch

from ds_kfac.integration import cuda_ops
from ds_kfac.optimizers import Lamb, resolve, resolve_lamb

CUDA = torch.device("cuda", 0)
PROBED = "9.0a"
"""What the stand-in builder probes when the variable is unset (the GPU image's failing way)."""


@pytest.mark.parametrize(
    "current, capabilities, expected",
    [
        (None, [(9, 0)], "9.0"),
        (None, [(9, 0), (8, 0), (9, 0)], "8.0;9.0"),
        ("  ", [(9, 0)], "9.0"),
        ("9.0a", [(9, 0)], "9.0"),
        ("9.0 10.0a", [(10, 0), (9, 0)], "9.0;10.0"),
        ("8.0;10.0f", [(8, 0)], "8.0"),
        ("9.0a+PTX", [(9, 0)], "9.0"),
        ("8.0;9.0+PTX", [(9, 0)], "8.0;9.0+PTX"),
        ("7.5 8.6", [(9, 0)], "7.5 8.6"),
        ("9.0a", [], "9.0a"),
        (None, [], None),
    ],
)
def test_buildable_arch_list(current: Optional[str], capabilities: list, expected: Optional[str]) -> None:
    assert cuda_ops.buildable_arch_list(current, capabilities) == expected


class FakeFusedLamb(Lamb):
    """DeepSpeed's FusedLamb as its JIT build behaves: ``ValueError`` on an arch entry with a suffix (or an unset
    variable, probed as :data:`PROBED`), built otherwise. Records the arch list of each build."""

    builds: list[Optional[str]] = []

    def __init__(self, params: Any, **kwargs: Any) -> None:
        arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST")
        FakeFusedLamb.builds.append(arch_list)
        for entry in cuda_ops.arch_entries(arch_list or PROBED):
            minor = entry.split(".")[1].split("+")[0]
            int(minor)  # DeepSpeed's parse: "invalid literal for int() with base 10: '0a'"
        super().__init__(params, **kwargs)


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two visible H100s (capability 9.0), DeepSpeed's FusedLamb the stand-in, DeepSpeed the only fused backend,
    and a process that has not logged the replacement yet."""
    import deepspeed.ops.lamb

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 0))
    monkeypatch.setattr(deepspeed.ops.lamb, "FusedLamb", FakeFusedLamb)
    monkeypatch.setattr(FakeFusedLamb, "builds", [])
    monkeypatch.setattr(
        resolve, "_FUSED_BACKENDS", (("deepspeed", resolve._deepspeed_unsupported, resolve._build_deepspeed),)
    )
    monkeypatch.setattr(cuda_ops, "_announced", False)


def build() -> torch.optim.Optimizer:
    return resolve_lamb([torch.nn.Parameter(torch.zeros(3))], lr=0.1, device=CUDA)


def replacement_logs(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == cuda_ops.__name__ and "TORCH_CUDA_ARCH_LIST" in r.getMessage()]


@pytest.mark.parametrize("user_value", ["9.0a", None])
def test_fused_lamb_builds_for_the_devices_and_the_variable_is_restored(
    gpu: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, user_value: Optional[str]
) -> None:
    if user_value is None:
        monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    else:
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", user_value)
    caplog.set_level(logging.INFO, logger=cuda_ops.__name__)
    for _ in range(2):
        assert type(build()) is FakeFusedLamb
        assert os.environ.get("TORCH_CUDA_ARCH_LIST") == user_value  # set or unset exactly as before
    assert FakeFusedLamb.builds == ["9.0", "9.0"]
    (record,) = replacement_logs(caplog)  # once for two builds
    assert record.levelno == (logging.INFO if user_value is None else logging.WARNING)
    assert record.getMessage().endswith("the visible devices, 9.0")
    assert (user_value or "is unset") in record.getMessage()


def test_a_parseable_list_is_left_alone(gpu: None, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    caplog.set_level(logging.INFO, logger=cuda_ops.__name__)
    assert type(build()) is FakeFusedLamb
    assert FakeFusedLamb.builds == ["8.0;9.0+PTX"] and not replacement_logs(caplog)
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0+PTX"


def test_the_parse_error_still_surfaces_without_devices(gpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """No capability to build for: the variable stays as it is, and DeepSpeed's error is the fallback's warning."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    with pytest.warns(RuntimeWarning, match=r"deepspeed LAMB failed to construct: ValueError\(\"invalid literal.*'0a'"):
        assert type(build()) is Lamb
    assert FakeFusedLamb.builds == ["9.0a"] and os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0a"


def test_another_failure_falls_back_with_its_message(gpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_ninja(params: Any, **kwargs: Any) -> None:
        assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0"
        raise RuntimeError("ninja not found")

    import deepspeed.ops.lamb

    monkeypatch.setattr(deepspeed.ops.lamb, "FusedLamb", no_ninja)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    with pytest.warns(
        RuntimeWarning, match=r"pure-PyTorch Lamb.*deepspeed LAMB failed.*RuntimeError\('ninja not found'"
    ):
        assert type(build()) is Lamb
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0a"
