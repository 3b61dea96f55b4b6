"""ds_kfac: distributed K-FAC gradient preconditioning for DeepSpeed and PyTorch."""

from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="ds_kfac",
    version="0.1.0",
    description="Distributed K-FAC gradient preconditioning for DeepSpeed/Megatron training",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["ds_kfac", "ds_kfac.*"]),
    python_requires=">=3.10",
    # torch is not capped: GPU clusters bring their own build. DeepSpeed is needed
    # for ds_kfac.initialize only; the standalone preconditioner runs on torch alone.
    # ds_kfac reads DeepSpeed internals (docs/maintainers.md), verified on this version only:
    # the same range as ds_kfac.integration.initialize.VERIFIED_DEEPSPEED, which warns outside it.
    install_requires=["torch>=2.1", "pydantic>=2"],
    # "hf": ds_kfac.hf.KFACTrainer (Hugging Face Trainer), verified on these versions (docs/maintainers.md).
    extras_require={
        "deepspeed": ["deepspeed==0.19.8"],
        "hf": ["deepspeed==0.19.8", "transformers==5.23.0", "accelerate==1.15.0"],
    },
)
