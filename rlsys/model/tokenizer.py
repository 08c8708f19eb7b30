"""A character-level tokenizer with a chat template, built locally (no model hub here), and tokenizers loaded by path.

transformers is imported where a tokenizer is made: the experiments name this module's functions, and the launcher,
which imports every experiment to read a run's settings, makes no tokenizer unless it builds the tiny model.
"""

import json
import string
from functools import lru_cache
from pathlib import Path


PAD, EOS, UNK = "<|pad|>", "<|end|>", "<|unk|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
CHARS = string.printable[:95]  # digits, letters, punctuation, space: every printable ASCII character

# Each message is <|role|>content<|end|>; the assistant's <|end|> is the model's end of sequence.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_char_tokenizer():
    """A transformers PreTrainedTokenizerFast of one token per printable character, with CHAT_TEMPLATE."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [PAD, EOS, UNK, *ROLE_TOKENS]
    vocab = {tok: i for i, tok in enumerate(specials + list(CHARS) + ["\n"])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK,
                                        additional_special_tokens=ROLE_TOKENS)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def chat_prompt_ids(tokenizer, prompt: str | list[dict]) -> list[int]:
    """Token ids of a chat (a user's text, or a list of messages), ending where the assistant's answer begins."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    text = tokenizer.apply_chat_template(template_roles(tokenizer, messages), add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def template_roles(tokenizer, messages: list[dict]) -> list[dict]:
    """`messages` with the `developer` role (OpenAI's newer name for the system role) as `system` where the chat
    template names no developer role (as vLLM tells, by the quoted name), as vLLM renders it: a template that knows
    system, user, assistant and tool drops a role it does not know (Qwen2.5's), refuses it (Qwen3.5's) or writes it
    as a role the model never saw. vLLM (0.32) then also merges every system message into one, first; here a message
    is never moved (a later one is appended after the ids the model saw, which a merge would change), so a template
    that wants the system message first refuses a later one, and the endpoint answers with its reason."""
    template = str(tokenizer.chat_template)
    if '"developer"' in template or "'developer'" in template:
        return messages
    return [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]


def row_prompt_ids(tokenizer, row: dict) -> list[int]:
    """A dataset row's prompt through the chat template: its `messages` (system prompt included) when it
    has them, else its `prompt` as the one user message. What the rollout worker sends, and the warm start teaches."""
    return chat_prompt_ids(tokenizer, row.get("messages") or row["prompt"])


def message_after_ids(tokenizer, generated: list[int], role: str, content: str) -> list[int]:
    """Token ids of one more message after a model's turn `generated`, then the assistant's prompt."""
    return messages_after_ids(tokenizer, generated, [{"role": role, "content": content}])


def messages_after_ids(tokenizer, generated: list[int], messages: list[dict]) -> list[int]:
    """Token ids of `messages` after a model's turn `generated`, then the assistant's prompt: eos first if the turn
    did not end with one (it was cut at max_new_tokens)."""
    closing = [] if generated and generated[-1] == tokenizer.eos_token_id else [tokenizer.eos_token_id]
    return closing + messages_continuation_ids(tokenizer, messages)


def messages_continuation_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids that follow an assistant turn ending in eos: `messages`, then the assistant's prompt.

    Rendered by the chat template after a stand-in exchange and cut right after that exchange's eos, so
    whatever a template puts between an assistant's eos and the next message (Qwen's newline) is kept
    rather than silently dropped at every turn boundary.
    """
    # keyed by the template's text too: a tokenizer's template may be changed in place, or be a dict of templates
    before = _stand_in_exchange(tokenizer, str(tokenizer.chat_template), tokenizer.eos_token)
    after = tokenizer.apply_chat_template(STAND_IN + list(messages), add_generation_prompt=True, tokenize=False)
    if not after.startswith(before):
        raise ValueError("this chat template renders earlier messages differently once a message follows them")
    return tokenizer(after[len(before):], add_special_tokens=False)["input_ids"]


STAND_IN = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]


@lru_cache(maxsize=8)
def _stand_in_exchange(tokenizer, chat_template: str, eos: str | None) -> str:
    """The stand-in exchange as the template renders it before a following message, through the assistant's eos.
    The same for every call with one template (the key: the tokenizer, its template and eos), so rendered once:
    three renders a turn would be most of the cost of appending a message."""
    before = tokenizer.apply_chat_template(STAND_IN, tokenize=False)
    if not (eos and eos in before):
        return before
    # The exchange as it renders once a message follows it, through the assistant's eos (the first after those of
    # the user's message): a template may render the last assistant turn apart (Qwen3 gives it an empty think
    # block, which earlier turns do not have).
    followed = tokenizer.apply_chat_template(STAND_IN + STAND_IN[:1], tokenize=False)
    ends = [i + len(eos) for i in range(len(followed)) if followed.startswith(eos, i)]
    earlier = tokenizer.apply_chat_template(STAND_IN[:1], tokenize=False).count(eos)
    return followed[:ends[earlier]] if len(ends) > earlier else before[:before.rindex(eos) + len(eos)]


GENERIC_TOKENIZER_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast"}


@lru_cache(maxsize=8)
def load_tokenizer(path: str):
    """One tokenizer per path and process: every episode of a worker shares it.

    A checkpoint whose tokenizer_config.json names the generic class (its tokenizer.json says everything) is
    loaded as exactly that. AutoTokenizer does not: transformers 5 loads any checkpoint whose config.json says
    `qwen2` with Qwen2Tokenizer, whatever tokenizer_config.json names, and that rebuilds the tiny model's
    character tokenizer without its spaces and newlines ("click[buy now]" becomes "click[buynow]").
    """
    from transformers import PreTrainedTokenizerFast

    config = Path(path) / "tokenizer_config.json"
    saved_class = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    if saved_class in GENERIC_TOKENIZER_CLASSES:
        return PreTrainedTokenizerFast.from_pretrained(path)
    # Imported here: AutoTokenizer brings transformers' model and generation code (about 20 s on a 2-core CPU),
    # which a role that only tokenizes for the tiny model never needs.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
