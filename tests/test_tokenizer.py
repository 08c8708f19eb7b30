"""The tiny model's character tokenizer, saved beside its Qwen2 weights, loads back as it was built."""

from experiments.common import ModelConfig
from rlsys.model.tiny import build_tiny_model
from rlsys.model.tokenizer import build_char_tokenizer, chat_prompt_ids, load_tokenizer, row_prompt_ids


def test_a_saved_tiny_model_loads_the_tokenizer_it_was_trained_with(tmp_path):
    # transformers 5 gives a config.json that says qwen2 its Qwen2Tokenizer, which drops spaces and newlines
    # from this vocabulary: the warm start trained on one text and every rollout then sent the model another.
    built = build_char_tokenizer()
    build_tiny_model(ModelConfig(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1), built, 0) \
        .save_pretrained(tmp_path)
    built.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))

    text = "buy sport headphones, blue\n[search]\nclick[buy now]"
    ids = loaded(text, add_special_tokens=False)["input_ids"]
    assert ids == built(text, add_special_tokens=False)["input_ids"]
    assert loaded.decode(ids) == text
    assert chat_prompt_ids(loaded, text) == chat_prompt_ids(built, text)
    assert (loaded.eos_token_id, loaded.pad_token_id) == (built.eos_token_id, built.pad_token_id)


def test_a_rows_developer_message_is_rendered_as_the_system_message_the_template_knows():
    """A dataset row in OpenAI's newer shape has a `developer` message: a template with no such role renders it as
    system, as the endpoint does (it was "<|developer|>" as plain characters)."""
    tokenizer = build_char_tokenizer()
    row = {"prompt": "12+34=", "messages": [{"role": "developer", "content": "Be brief."},
                                            {"role": "user", "content": "12+34="}]}
    assert row_prompt_ids(tokenizer, row) == tokenizer("<|system|>Be brief.<|end|><|user|>12+34=<|end|><|assistant|>",
                                                       add_special_tokens=False)["input_ids"]
