"""Loading the learner's models: the policy, and for GAE a critic that shares the policy's architecture."""

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

from rlsys.model.varlen_attention import ATTN_IMPLEMENTATION

CRITIC_DIR = "critic"  # a checkpoint's critic, saved beside the policy in HF format


def attention_for(packing: bool, requested: str = "auto") -> str:
    """Packed rows need attention that keeps to each sequence; padded rows use transformers' sdpa."""
    if requested != "auto":
        return requested
    return ATTN_IMPLEMENTATION if packing else "sdpa"


def load_policy(path: str, packing: bool, attention: str = "auto"):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                attn_implementation=attention_for(packing, attention))


def load_critic(path: str, packing: bool, attention: str = "auto"):
    """The policy's backbone with a one-output linear head per token: V(prefix up to and including the token).

    Started from the policy's weights, as in InstructGPT's PPO, so the critic reads the prompt as the policy
    does; dropout is off, since it would add noise to the regression targets the critic is trained on.
    """
    config = AutoConfig.from_pretrained(path, num_labels=1)
    config.classifier_dropout = 0.0
    return AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=torch.float32,
                                                           attn_implementation=attention_for(packing, attention))
