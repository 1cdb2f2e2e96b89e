from setuptools import find_packages, setup

setup(
    name="megatron-snip",
    version="0.1.0",
    description="Megatron-style 3D-parallel Llama pretraining with SNIP adaptive mixed precision",
    license="Apache-2.0",
    python_requires=">=3.11",
    packages=find_packages(include=["megatron_snip", "megatron_snip.*"]),
    install_requires=[
        "torch>=2.4",
        "megatron-core==0.16.1",
        "numpy",
        "psutil",
        "sentencepiece",
        "tensorboard",
        "tqdm",
        "matplotlib",
        "highspy",
        "tokenizers>=0.21",   # --tokenizer-type HuggingFaceTokenizer
        "safetensors>=0.4",   # tools/convert_hf_llama.py
        "pyyaml",             # megatron-core's per-module precision configs (--te-precision-config-file)
    ],
    extras_require={
        "gurobi": ["gurobipy"],
        "te": ["transformer_engine[pytorch]"],
        "wandb": ["wandb"],  # --wandb-project
        "test": ["pytest", "hypothesis", "gurobipy", "transformers==5.23.0", "triton; platform_system == 'Linux'",
                 "wandb"],
    },
)
