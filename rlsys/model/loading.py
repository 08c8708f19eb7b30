"""Loading the learner's models: the policy, and for GAE a critic that shares the policy's architecture."""

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

from rlsys.model.varlen_attention import ATTN_IMPLEMENTATION

CRITIC_DIR = "critic"  # a checkpoint's critic, saved beside the policy in HF format


def attention_for(requested: str = "auto") -> str:
    """auto: rlsys's varlen attention, which keeps each sequence of a packed row to itself and takes right-padded
    rows with no mask (causal attention never lets a real token see the padding after it), so no padding mask
    is built or read back per forward pass."""
    return ATTN_IMPLEMENTATION if requested == "auto" else requested


def check_full_attention(config, max_len: int, who: str, instead: str) -> None:
    """NotImplementedError for a model whose attention is limited to a window within its `max_len`-token sequences:
    rlsys's attention (the learner's packed rows, the transformers engine's left-padded ones) spans whole sequences,
    so it would compute other logprobs than the model's (and vLLM's) past the window."""
    types = set(getattr(config, "layer_types", None) or ())
    windowed = not types and getattr(config, "use_sliding_window", True)  # Qwen2 names a window it does not use
    window = getattr(config, "sliding_window", None) if windowed else None
    if types - {"full_attention"}:
        why = f"layers of types {sorted(types)}"
    elif window and window < max_len:
        why = f"a sliding window of {window} tokens, within its {max_len}-token sequences"
        instead = f"set inference.max_model_len={window} or less, or {instead}"
    else:
        return
    raise NotImplementedError(f"{who} runs full-attention models only; this one has {why}: {instead}")


def load_policy(path: str, attention: str = "auto"):
    """The policy, dropout off (`without_dropout`)."""
    return without_dropout(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                attn_implementation=attention_for(attention)))


def without_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every dropout at 0, its config (what checkpoints save) unchanged. The learner trains in train mode
    (gradient checkpointing acts only there), where a model with dropout (GPT-2's, OPT's 0.1) would score each pass
    with other units dropped: logprobs unlike the engine's, ratios other than 1 on-policy, a KL at the first step.
    Dropout is a module (nn.Dropout) or a rate an attention layer keeps as a number (Llama's `attention_dropout`)."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name, value in vars(module).items():
            if "dropout" in name and type(value) is float:
                setattr(module, name, 0.0)
    return model


def load_critic(path: str, attention: str = "auto"):
    """The policy's backbone with a one-output linear head per token: V(prefix up to and including the token).

    Started from the policy's weights, as in InstructGPT's PPO, so the critic reads the prompt as the policy
    does; dropout is off, since it would add noise to the regression targets the critic is trained on.
    A head the checkpoint lacks (a policy's) starts at zero: a critic that knows nothing predicts one value for
    every prefix, so the first advantages are the returns against the batch's baseline, not the noise of a random
    head, which explained less of the returns than a constant for the first 8-10 steps and stopped a 24-step run
    learning (BENCHMARKS.md, "GAE's first steps").
    """
    config = AutoConfig.from_pretrained(path, num_labels=1)
    critic, loading = AutoModelForTokenClassification.from_pretrained(
        path, config=config, dtype=torch.float32, attn_implementation=attention_for(attention),
        output_loading_info=True)
    # The head is whatever the checkpoint lacks outside the backbone: `score` (Llama's, Qwen2's), `classifier` (GPT-2's)
    backbone = critic.base_model_prefix + "."
    with torch.no_grad():
        for key in loading["missing_keys"]:
            if not key.startswith(backbone):
                critic.get_parameter(key).zero_()
    return without_dropout(critic)
