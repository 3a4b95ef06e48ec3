from setuptools import find_namespace_packages, setup

setup(
    name="gspo-megatron",
    version="0.1.0",
    description="GSPO reinforcement learning for Mixture-of-Experts LLMs on Megatron-Core",
    python_requires=">=3.11",
    # the asset folders (data, no __init__.py) are namespace packages: declared, so setuptools neither warns that
    # they "would be ignored" nor leaves them out; their files are the package data below
    packages=find_namespace_packages(include=["gspo_megatron", "gspo_megatron.*"]),
    package_data={
        "gspo_megatron.assets.tokenizer": ["*.json", "*.jinja"],
        "gspo_megatron.assets.tool_tokenizer": ["*.json", "*.jinja"],
        "gspo_megatron.assets.sglang_cpu": ["*.c"],
    },
    install_requires=[
        # GPU users install their CUDA build of torch first; pip keeps it when it satisfies this pin's range.
        "torch>=2.6",
        # The CPU runtime (gspo_megatron/megatron/cpu_runtime.py) knows the patches of each of these versions
        # and refuses others. 0.17 and newer need Python 3.12, so 3.11 stays on 0.16.1.
        "megatron-core==0.16.1; python_version < '3.12'",
        "megatron-core>=0.16.1,<=0.19.2; python_version >= '3.12'",
        "transformers>=5.0,<6",
        "safetensors>=0.4",
        "psutil",
        "numpy",
        "pyyaml",
        "rich",
        "tqdm",
        "matplotlib",
        "math-verify>=0.7",
        "pyarrow",
        "tensorboard",
    ],
    extras_require={
        # apex is built from source (see docs/installation.md); it is not on PyPI.
        # The GPU path (TE layer names, the clip_and_step mirror, MLA, the distributed optimizer) was read against
        # megatron-core 0.16.1 only, so the gpu extra pins it on every Python (the base range above is what the
        # CPU legs test); Transformer Engine takes the range megatron-core 0.16.1 declares (its METADATA,
        # extra "dev"). docs/gpu.md, docs/installation.md.
        "gpu": ["megatron-core==0.16.1", "transformer-engine[pytorch]>=2.9.0a0,<2.12.0",
                "sglang>=0.5.23,<0.6"],  # docs/rollout.md: protocol read in 0.5.23
        "dev": ["pytest", "pytest-timeout", "hypothesis"],
        "wandb": ["wandb"],
    },
    entry_points={"console_scripts": ["gspo-megatron=gspo_megatron.cli:main"]},
)
