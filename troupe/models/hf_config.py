"""Hugging Face config.json to and from troupe's GPTConfig: which families map onto troupe's
decoder (GPT-2, the Llama family, Mixtral and Qwen2-MoE) and how each field translates. The
weights' name map and the safetensors reading and writing are troupe.models.hf."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from troupe.config import ConfigError
from troupe.models.gpt import GPTConfig
from troupe.models.layers import rope_type
from troupe.models.moe import MoEConfig

LLAMA_FAMILY = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "mixtral": "MixtralForCausalLM",
                "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM"}
QWEN = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")  # sliding from layer max_window_layers on
SUPPORTED = ("gpt2", *LLAMA_FAMILY)


# config.json's name of each GPTConfig field, for errors (GPT-2's own names, else Llama's)
_HF_NAMES = {"gpt2": {"vocab_size": "vocab_size", "seq_len": "n_positions", "n_layer": "n_layer",
                      "n_head": "n_head", "d_model": "n_embd", "d_ff": "n_inner"},
             "llama": {"vocab_size": "vocab_size", "seq_len": "max_position_embeddings",
                       "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
                       "d_model": "hidden_size", "d_ff": "intermediate_size",
                       "n_kv_head": "num_key_value_heads", "head_dim": "head_dim",
                       "rope_scaling": "rope_scaling",
                       "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps"}}


def config_from_hf(hf: dict[str, Any], where: str = "config.json") -> GPTConfig:
    """troupe's GPTConfig for a Hugging Face config.json (as a dict), validated like a recipe:
    ValueError naming the file and config.json's key for a missing, non-positive or
    inconsistent value."""
    if not isinstance(hf, dict):
        raise ValueError(f"{where}: holds a {type(hf).__name__}, not a JSON object")
    names = _HF_NAMES["gpt2" if hf.get("model_type") == "gpt2" else "llama"]
    for key in names.values():
        value = hf.get(key)
        if key not in ("rope_scaling", "rope_theta", "rms_norm_eps") and value is not None \
                and (type(value) is not int or value < 1):
            raise ValueError(f"{where}: {key}={value!r} must be a positive integer")
    try:
        return _config_from_hf(hf, where)
    except KeyError as e:
        raise ValueError(f"{where}: no {e.args[0]!r}, which this model_type needs") from None
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"])
        key = names.get(field, field) if field else "the model's shape"
        raise ValueError(f"{where}: {key}: {err['msg'].removeprefix('Value error, ')}") \
            from None


def _config_from_hf(hf: dict[str, Any], where: str) -> GPTConfig:
    kind = hf.get("model_type")
    if kind == "gpt2":
        return _gpt2_config(hf, where)
    if kind not in LLAMA_FAMILY:
        raise ValueError(f"{where}: model_type {kind!r} is not supported; troupe loads "
                         f"{', '.join(SUPPORTED)}")
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    # a head_dim that says what hidden_size / num_attention_heads says is no news; another
    # one (Mistral-Nemo, Mistral-Small) sets the heads' width apart from the model's
    head_dim = hf.get("head_dim")
    head_dim = None if head_dim is not None and head_dim * heads == d else head_dim
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {hf['hidden_act']!r} is not supported (silu is)")
    rope = hf.get("rope_parameters") or {}
    seq_len = hf.get("max_position_embeddings", 2048)
    scaling = _rope_scaling(hf, rope, seq_len)
    window, sliding = _sliding(hf, kind, where) if kind != "llama" else (None, None)
    bias = hf.get("attention_bias", False)
    moe = _moe_config(hf, kind)
    return GPTConfig(
        vocab_size=hf["vocab_size"], seq_len=seq_len, n_layer=hf["num_hidden_layers"],
        n_head=heads, d_model=d, d_ff=hf["intermediate_size"],
        n_kv_head=hf.get("num_key_value_heads") or heads, head_dim=head_dim,
        sliding_window=window, sliding_layers=sliding, norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps", 1e-6), positions="rope",
        rope_theta=hf.get("rope_theta", rope.get("rope_theta", 10000.0)),
        rope_scaling=scaling, mlp="swiglu",
        qkv_bias=bias or kind == "qwen2" or (kind == "qwen2_moe" and hf.get("qkv_bias", True)),
        out_bias=bias, mlp_bias=hf.get("mlp_bias", False),
        qk_norm=kind in ("qwen3", "qwen3_moe"),
        tie_embeddings=hf.get("tie_word_embeddings", kind == "gpt2"), moe=moe)


def _gpt2_config(hf: dict[str, Any], where: str) -> GPTConfig:
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"{where}: activation_function {act!r} is not supported")
    # attention scaled otherwise than by 1 / sqrt(head size) would load without a word
    # and give other logits
    for key, usual in (("scale_attn_weights", True),
                       ("scale_attn_by_inverse_layer_idx", False)):
        if bool(hf.get(key, usual)) != usual:
            raise ValueError(f"{where}: {key}={hf[key]!r} is not supported (troupe scales "
                             "attention by 1 / sqrt(head size) in every layer)")
    return GPTConfig(vocab_size=hf["vocab_size"], seq_len=hf["n_positions"],
                     n_layer=hf["n_layer"], n_head=hf["n_head"], d_model=hf["n_embd"],
                     d_ff=hf.get("n_inner"), norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                     mlp="gelu" if act == "gelu" else "gelu_tanh", qkv_bias=True)


def _rope_scaling(hf: dict[str, Any], rope: dict[str, Any], seq_len: int) -> dict | None:
    """The rotary scaling of a config (``rope_scaling``, or transformers 5's
    ``rope_parameters`` when it scales), YaRN's defaults filled as transformers reads them."""
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type") not in (None, "default")
                                         else None)
    if rope_type(scaling) == "yarn":
        # as transformers reads YaRN: the original context defaults to this one, and the
        # factor to their ratio
        scaling = dict(scaling)
        scaling.setdefault("original_max_position_embeddings", seq_len)
        old = scaling["original_max_position_embeddings"]
        if scaling.get("factor") is None and type(old) is int and old > 0:
            scaling["factor"] = seq_len / old
    return scaling


def _moe_config(hf: dict[str, Any], kind: str) -> MoEConfig | None:
    """Mixtral's and the Qwen MoEs' expert layers (None for a dense model)."""
    if kind == "mixtral":
        jitter = hf.get("router_jitter_noise") or 0.0
        return MoEConfig(num_experts=hf["num_local_experts"], expert_interval=1,
                         top_k=hf["num_experts_per_tok"], dropless=True,
                         aux_loss_coef=hf.get("router_aux_loss_coef", 0.001),
                         noisy_gate="jitter" if jitter else "none", jitter_eps=jitter)
    if kind in ("qwen2_moe", "qwen3_moe"):  # Qwen3-MoE: Qwen2-MoE without a shared expert
        experts = hf["num_experts"] if "num_experts" in hf or kind == "qwen2_moe" \
            else hf["num_local_experts"]
        return MoEConfig(num_experts=experts, expert_interval=hf.get("decoder_sparse_step", 1),
                         top_k=hf["num_experts_per_tok"], dropless=True,
                         aux_loss_coef=hf.get("router_aux_loss_coef", 0.001),
                         dense_layers=hf.get("mlp_only_layers") or [],
                         expert_d_ff=hf["moe_intermediate_size"],
                         normalize_top_k=hf.get("norm_topk_prob", kind == "qwen3_moe"),
                         shared_expert_d_ff=hf.get("shared_expert_intermediate_size") or None)
    return None


def _sliding(hf: dict[str, Any], kind: str, where: str) -> tuple[int | None, list[int] | None]:
    """(sliding_window, sliding_layers) of GPTConfig: Mistral's and Mixtral's window in every
    layer; Qwen2's from layer max_window_layers on, with use_sliding_window; or the layers
    layer_types marks "sliding_attention", where config.json lists them. (None, None): no
    layer slides (a window of null or 0, as transformers writes for none)."""
    window, n = hf.get("sliding_window"), hf["num_hidden_layers"]
    if window is None or window == 0:
        return None, None
    if type(window) is not int or window < 0:
        raise ValueError(f"{where}: sliding_window={window!r} must be a positive integer")
    types = hf.get("layer_types")
    if isinstance(types, list):
        layers = [i for i, t in enumerate(types) if t == "sliding_attention"]
    elif kind in QWEN:
        first = hf.get("max_window_layers", 0)
        layers = list(range(first, n)) if hf.get("use_sliding_window") else []
    else:
        layers = list(range(n))
    if not layers:
        return None, None
    return window, None if layers == list(range(n)) else layers


def read_config(directory: str | Path) -> GPTConfig:
    """The GPTConfig of the Hugging Face model directory ``directory`` (its config.json)."""
    return config_from_hf(*config_json(directory))


def context_length(directory: str | Path) -> tuple[int, str]:
    """The context of the Hugging Face model in ``directory`` (the longest sequence it
    reads), and where it is written, for messages: ``(2048, ".../config.json
    max_position_embeddings")``."""
    hf, where = config_json(directory)
    key = _HF_NAMES["gpt2" if hf.get("model_type") == "gpt2" else "llama"]["seq_len"]
    return config_from_hf(hf, where).seq_len, f"{where} {key}"


def config_json(directory: str | Path) -> tuple[dict[str, Any], str]:
    """A model directory's config.json as a dict, and the file's path (for errors)."""
    path = Path(directory).expanduser() / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path.parent}: no config.json (not a Hugging Face model "
                                "directory)")
    try:
        return json.loads(path.read_text()), str(path)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def check_pretrained(directory: str | None, key: str = "model.pretrained") -> None:
    """What an app checks before anything starts: ``directory`` (the config key ``key``) is a
    Hugging Face directory of an architecture troupe loads; FileNotFoundError or ConfigError
    naming the key otherwise."""
    if directory is None:
        return
    try:
        read_config(directory)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{key}={directory!r}: {e}") from None
    except (ValueError, KeyError) as e:
        raise ConfigError(f"{key}={directory!r}: {e}") from None


def config_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    """The Hugging Face config.json of a GPTConfig: GPT-2 for learned positions, Llama (or
    Qwen2, whose qkv has a bias and output projection none) for rotary ones, Mixtral for MoE."""
    if cfg.moe is not None and (cfg.positions, cfg.norm, cfg.mlp) != ("rope", "rmsnorm", "swiglu"):
        raise ValueError("save_pretrained: MoE models export as Mixtral, which needs rotary "
                         "positions, RMSNorm and SwiGLU experts (troupe's PR-MoE GPT has none)")
    if cfg.positions == "learned":
        return _gpt2_to_hf(cfg)
    if cfg.norm != "rmsnorm" or cfg.mlp != "swiglu":
        raise ValueError("save_pretrained: rotary positions export as Llama, which needs "
                         "RMSNorm and a SwiGLU MLP")
    qwen = cfg.qkv_bias and not cfg.out_bias
    if cfg.qkv_bias != cfg.out_bias and not qwen:
        raise ValueError("save_pretrained: an output bias without a qkv bias has no HF family")
    kind = "qwen2" if qwen else "llama"
    if cfg.qk_norm:
        kind = _qwen3_family(cfg)
    elif cfg.moe is not None:
        kind = _moe_family(cfg)
    window = _window_to_hf(cfg, kind)
    if window.get("model_type"):
        kind = window.pop("model_type")
    out = {"architectures": [LLAMA_FAMILY[kind]], "model_type": kind,
           "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
           "intermediate_size": cfg.d_ff or 4 * cfg.d_model, "num_hidden_layers": cfg.n_layer,
           "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.kv_heads,
           "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps,
           "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
           "hidden_act": "silu", "tie_word_embeddings": cfg.tie_embeddings,
           "torch_dtype": "float32"}
    if cfg.head_dim is not None:
        out["head_dim"] = cfg.head_dim
    out.update(window)
    if kind == "llama":
        out.update(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)
    if kind in ("qwen3", "qwen3_moe"):
        out["attention_bias"] = cfg.qkv_bias
    if cfg.moe is not None:
        out.update(_moe_to_hf(cfg, kind, out["intermediate_size"]))
    return out


def _gpt2_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    """GPT-2's config.json, for a model with learned positions."""
    if cfg.norm != "layernorm" or cfg.mlp == "swiglu" or not cfg.tie_embeddings or \
            cfg.kv_heads != cfg.n_head or not (cfg.out_bias and cfg.mlp_bias) or \
            cfg.sliding_window is not None or cfg.head_size * cfg.n_head != cfg.d_model:
        raise ValueError("save_pretrained: learned positions export as GPT-2, which needs "
                         "LayerNorm, a GELU MLP with biases, tied embeddings, no GQA, no "
                         "sliding window, and heads that span the width")
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": cfg.vocab_size, "n_positions": cfg.seq_len, "n_embd": cfg.d_model,
            "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": cfg.d_ff,
            "layer_norm_epsilon": cfg.norm_eps, "tie_word_embeddings": True,
            "activation_function": "gelu" if cfg.mlp == "gelu" else "gelu_new",
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "torch_dtype": "float32"}


def _moe_to_hf(cfg: GPTConfig, kind: str, d_ff: int) -> dict[str, Any]:
    """The expert settings of Mixtral's or a Qwen MoE's config.json."""
    moe, out = cfg.moe, {}
    if kind == "mixtral":
        out.update(num_local_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                   router_aux_loss_coef=moe.aux_loss_coef,
                   router_jitter_noise=moe.jitter_eps if moe.noisy_gate == "jitter" else 0.0)
    if kind in ("qwen2_moe", "qwen3_moe"):
        out.update(num_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                   router_aux_loss_coef=moe.aux_loss_coef, decoder_sparse_step=moe.expert_interval,
                   mlp_only_layers=moe.dense_layers, norm_topk_prob=moe.normalize_top_k,
                   moe_intermediate_size=moe.expert_d_ff or d_ff)
    if kind == "qwen2_moe":
        out.update(shared_expert_intermediate_size=moe.shared_expert_d_ff, qkv_bias=cfg.qkv_bias)
    return out


def _moe_needs(moe: MoEConfig) -> list[tuple[bool, str]]:
    """(fails, what every Hugging Face MoE family needs) for ``moe``."""
    return [(not isinstance(moe.num_experts, int), "one expert count for all layers"),
            (not moe.dropless, "dropless routing"),
            (moe.residual, "no Residual MoE"),
            (moe.noisy_gate == "rsample", "no rsample gate noise")]


def _qwen3_family(cfg: GPTConfig) -> str:
    """Qwen3, or Qwen3-MoE for an MoE config: the families whose heads normalise q and k
    (qk_norm); a ValueError saying what they cannot describe."""
    moe = cfg.moe
    why = [reason for bad, reason in (
        (cfg.qkv_bias != cfg.out_bias, "a bias on all of q, k, v and the output or on none"),
        (cfg.mlp_bias, "no MLP biases"),
        *(_moe_needs(moe) if moe is not None else []),
        (moe is not None and moe.shared_expert_d_ff is not None, "no shared expert"))
        if bad]
    if why:
        raise ValueError("save_pretrained: q and k normalised per head (qk_norm) export as "
                         "Qwen3 or Qwen3-MoE, which need " + ", ".join(why))
    return "qwen3" if moe is None else "qwen3_moe"


def _window_to_hf(cfg: GPTConfig, kind: str) -> dict[str, Any]:
    """config.json's keys for cfg's sliding window in family ``kind`` (with "model_type"
    when the window moves a Llama to Mistral, the Llama layout that has one); a ValueError
    where no family describes it."""
    if kind == "mixtral":
        base = {"sliding_window": None}
    elif kind in QWEN:
        base = {"use_sliding_window": False, "sliding_window": None}
    else:
        base = {}
    if cfg.sliding_window is None:
        return base
    n = cfg.n_layer
    layers = list(range(n)) if cfg.sliding_layers is None else sorted(cfg.sliding_layers)
    if kind in QWEN and layers == list(range(layers[0], n)):
        return {"use_sliding_window": True, "sliding_window": cfg.sliding_window,
                "max_window_layers": layers[0]}
    if layers == list(range(n)) and kind == "mixtral":
        return {"sliding_window": cfg.sliding_window}
    if layers == list(range(n)) and kind == "llama" and not (cfg.qkv_bias or cfg.mlp_bias):
        return {"sliding_window": cfg.sliding_window, "model_type": "mistral"}
    raise ValueError(f"save_pretrained: a sliding window in layers {layers} of {n} has no "
                     "Hugging Face family: Mistral and Mixtral slide in every layer (Mistral "
                     "without biases), Qwen2 and Qwen3 from one layer to the last")


def _moe_family(cfg: GPTConfig) -> str:
    """The Hugging Face family of an MoE GPTConfig: Qwen2-MoE with a shared expert, else
    Mixtral; a ValueError saying what neither can describe."""
    moe = cfg.moe
    qwen = moe.shared_expert_d_ff is not None
    why = [reason for bad, reason in (
        *_moe_needs(moe),
        (cfg.out_bias or cfg.mlp_bias, "no output or MLP biases"),
        (not qwen and cfg.qkv_bias, "no qkv bias (Mixtral)"),
        (not qwen and (moe.expert_interval != 1 or moe.dense_layers),
         "an MoE layer in every block (Mixtral)"),
        (not qwen and not moe.normalize_top_k, "renormalised top-k weights (Mixtral)"),
        (not qwen and moe.expert_d_ff not in (None, cfg.d_ff or 4 * cfg.d_model),
         "experts as wide as d_ff (Mixtral)"))
        if bad]
    if why:
        raise ValueError("save_pretrained: MoE models export as Mixtral or Qwen2-MoE (with a "
                         "shared expert), which need " + ", ".join(why))
    return "qwen2_moe" if qwen else "mixtral"
