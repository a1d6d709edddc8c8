"""Tiny Hugging Face model directories that tests build offline."""

import torch

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<end>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def save_tiny_llama(path, family: str = "llama", **shape):
    """A tiny random Llama (2 layers, GQA) and a character-level tokenizer for digits and
    "sort: " with a chat template, saved as a Hugging Face directory at ``path``. ``family``
    "qwen3" makes it a Qwen3 (q and k normalised per head, heads of 16 over a width of 32),
    "mistral" a Mistral whose sliding window of 4 is shorter than a prompt. ``shape``: config
    fields to change (e.g. SmolLM2's 9 query and 3 key/value heads)."""
    import tokenizers
    import transformers
    chars = list("0123456789sort: ")
    specials = ["<end>", "<user>", "<assistant>"]
    vocab = {**{t: i for i, t in enumerate(specials)},
             **{c: i + len(specials) for i, c in enumerate(chars)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<end>"))
    tok.add_special_tokens(specials)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    # ByteFallback before Fuse: the decoder form llguidance reads (structured outputs)
    tok.decoder = tokenizers.decoders.Sequence([tokenizers.decoders.ByteFallback(),
                                                tokenizers.decoders.Fuse()])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<end>",
                                                pad_token="<end>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)
    config, model, extra = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=16)),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                    dict(sliding_window=4)),
    }[family]
    fields = dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=48,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                  **extra)
    cfg = config(**{**fields, **shape})
    torch.manual_seed(0)
    model(cfg).save_pretrained(path)
    return path
