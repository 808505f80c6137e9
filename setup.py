"""capture-megatron: memory-balanced pipeline partitions and parallel plans for Megatron-Core."""
from setuptools import find_packages, setup

setup(
    name="capture_megatron",
    version="0.3.0",
    description="Profile, predict and balance per-GPU peak memory of Megatron-Core training (CAPTURE)",
    packages=find_packages(include=["capture_megatron", "capture_megatron.*"]),
    package_data={"capture_megatron": ["data/*.txt", "data/*.json", "megatron/*.txt", "templates/*.sh"]},
    python_requires=">=3.10",
    install_requires=[
        # torch is installed first by `make setup` (pip install torch==2.13.0, the CPU build on disk);
        # the range here admits it and never pulls a newer (CUDA) build on its own.
        "torch>=2.6,<=2.13.0",
        "megatron-core>=0.16.1,<0.17",
        "numpy>=1.26",
        "scipy>=1.11",
        "psutil>=5.9",
        "matplotlib>=3.8",
        "tqdm>=4.66",
        "tokenizers>=0.19",
    ],
    extras_require={
        "test": ["pytest>=8", "sentencepiece>=0.2"],
        "sentencepiece": ["sentencepiece>=0.2"],
    },
    entry_points={"console_scripts": ["capture-megatron=capture_megatron.cli:main"]},
)
