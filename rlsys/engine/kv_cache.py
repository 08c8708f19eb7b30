"""What a decoder's KV cache takes a token: the engines size their caches by it."""


def kv_bytes_per_token(config, itemsize: int) -> int:
    """Keys and values of every layer for one token, in bytes, for a model of the standard attention layout
    (num_key_value_heads heads of head_dim each, grouped-query attention included), numbers of `itemsize` bytes."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * itemsize
