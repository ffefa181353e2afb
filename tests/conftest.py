"""Shared fixtures: the default model folder and engine, tiny random HF models, transformers."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

if not torch.cuda.is_available():
    # NOTE: before any kernel module is imported: Triton kernels then run in its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hsserve import Engine, EngineConfig
from hsserve.models.default_model import ensure_default_model
from tiny_models import tiny_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="session")
def smollm_dir() -> str:
    return ensure_default_model(os.environ.get("HSSERVE_CACHE_DIR", ""))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm_dir):
    """family -> folder with random weights (seeded) saved as safetensors + tokenizer."""
    from transformers import AutoModelForCausalLM

    made: dict[str, str] = {}

    def make(family: str) -> str:
        if family not in made:
            torch.manual_seed(1234)
            model = AutoModelForCausalLM.from_config(tiny_config(family), dtype=torch.float32)
            folder = str(tmp_path_factory.mktemp(f"tiny-{family}"))
            model.save_pretrained(folder)
            for f in TOKENIZER_FILES:
                if os.path.exists(os.path.join(smollm_dir, f)):
                    shutil.copy(os.path.join(smollm_dir, f), folder)
            made[family] = folder
        return made[family]

    return make


@pytest.fixture(scope="session")
def smollm_engine(smollm_dir):
    engine = Engine(EngineConfig(model=smollm_dir, device="cpu", max_num_seqs=32)).start()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def hf_model():
    """folder -> transformers model (float32, eager attention), cached."""
    from transformers import AutoModelForCausalLM

    cache: dict[str, object] = {}

    def load(folder: str):
        if folder not in cache:
            cache[folder] = AutoModelForCausalLM.from_pretrained(
                folder, dtype=torch.float32, attn_implementation="eager"
            ).eval()
        return cache[folder]

    return load
