"""Tiny random Hugging Face models for tests (no downloads)."""

from pathlib import Path

# A tiny Qwen3 shape with head_dim 32 (vLLM's CPU attention needs >= 32).
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1e6,
            tie_word_embeddings=False, max_position_embeddings=256, rms_norm_eps=1e-6)


def make_hf_model(path: Path | None = None, *, arch: str = "qwen3", seed: int = 0, **overrides):
    """A random fp32 transformers model (eval mode); saved to `path` if given.

    `arch`: "qwen3", "qwen2" or "llama". Qwen2 gets no `head_dim` unless `overrides` gives one
    (as Qwen2.5's config.json: head_dim = hidden_size / num_attention_heads)."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    kwargs = {**TINY, **overrides}
    if arch == "qwen2" and "head_dim" not in overrides:
        del kwargs["head_dim"]
    classes = {"qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
               "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
               "llama": (tf.LlamaConfig, tf.LlamaForCausalLM)}
    config_cls, model_cls = classes[arch]
    model = model_cls(config_cls(**kwargs)).eval()
    # Random norms and biases too, so a swapped or dropped norm weight or bias changes the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn_like(p))
    if path is not None:
        model.save_pretrained(path)
    return model
