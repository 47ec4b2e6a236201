"""Seeded tiny random-weight checkpoints in real Hugging Face format, for fast tests and demos.

The folder holds config.json, model.safetensors (written by transformers' own model class, so
it is exactly what a hub checkpoint looks like), and a real tokenizer.json (a small byte-level
BPE trained offline on a fixed text) with a ChatML chat template in tokenizer_config.json.
"""

from __future__ import annotations

import os
from pathlib import Path

_TEXT = (
    "The quick brown fox jumps over the lazy dog. Prefill runs in one datacenter and decode in "
    "another; a relay decoder beside prefill hides the wide area network latency. Tokens stream "
    "back to the user while key value blocks travel. Hello world! How are you today? I am fine, "
    "thank you. Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000. Caching shared prefixes saves compute. "
)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

ARCH_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def build_tokenizer(vocab_size: int = 384):
    """A deterministic byte-level BPE tokenizer wrapped for transformers (chat template set)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_TEXT] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_checkpoint(
    path: str | os.PathLike,
    arch: str = "llama",
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    **extra: object,
) -> str:
    """Write a tiny seeded checkpoint of the given architecture to ``path``; returns the path."""
    import torch
    import transformers

    if arch not in ARCH_CLASSES:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {sorted(ARCH_CLASSES)}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    cfg_cls, model_cls = (getattr(transformers, n) for n in ARCH_CLASSES[arch])
    kwargs: dict = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if arch == "qwen3":
        kwargs["head_dim"] = hidden_size // num_heads
    kwargs.update(extra)
    config = cfg_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():  # larger-than-default init so logits are not all near zero
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
            elif p.dim() == 1 and "norm" in "".join(n for n, q in model.named_parameters() if q is p):
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.02)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return str(out)
