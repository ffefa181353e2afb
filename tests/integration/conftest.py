"""Provides the triton_server fixture: a real tritonserver on free ports, with llm_capped.

A real tritonserver on free ports, serving a copy of the repository's model_repository plus
`llm_capped` (the same model with a lower hidden-state ceiling, a few captured layers,
HIDDEN_STATES declared TYPE_BF16, and its engine in the stub instead of a child process) and
`llm_spec` (the same model with n-gram speculative decoding), `llm_eagle3` (the tiny Llama with a
random EAGLE-3 head)."""

from __future__ import annotations

import os
import re
import shutil

import pytest

from eagle3_heads import write_head
from hsserve.triton.server import start_server

REPO = os.path.join(os.path.dirname(__file__), "..", "..", "model_repository")


def set_parameter(config_path: str, key: str, value: str) -> None:
    with open(config_path) as f:
        text = f.read()
    pattern = r'(key: "%s", value: \{ string_value: ")[^"]*(")' % re.escape(key)
    text, n = re.subn(pattern, r"\g<1>%s\g<2>" % value, text)
    assert n == 1, key
    with open(config_path, "w") as f:
        f.write(text)


FAMILIES = ("phi3", "gemma2", "gemma3", "mixtral", "qwen3_moe")  # NOTE: served as llm_<family>, tiny random models


def make_repository(root: str, smollm_dir: str, family_dirs: dict[str, str] | None = None,
                    tp_dir: str | None = None, eagle3: tuple[str, str] | None = None) -> str:
    """family_dirs: served as llm_<name> (in the stub); tp_dir: as llm_tp2 over two ranks;
    eagle3: (model, head) served as llm_eagle3."""
    repo = os.path.join(root, "model_repository")
    shutil.copytree(REPO, repo, ignore=shutil.ignore_patterns("__pycache__"))
    capped = os.path.join(repo, "llm_capped")
    shutil.copytree(os.path.join(repo, "llm"), capped)
    cfg = os.path.join(capped, "config.pbtxt")
    with open(cfg) as f:
        text = f.read().replace('name: "llm"', 'name: "llm_capped"')
    with open(cfg, "w") as f:
        f.write(text)
    set_parameter(cfg, "hidden_states_ceiling", "last")
    set_parameter(cfg, "hidden_layers_captured", "0 15 -1")
    set_parameter(cfg, "max_num_seqs", "4")
    set_parameter(cfg, "max_queue_size", "4")  # NOTE: the overload test fills it
    set_parameter(cfg, "engine_process", "false")  # NOTE: llm's engine runs in a child, this one in the stub
    with open(cfg) as f:  # NOTE: rows in bfloat16 (DLPack: numpy has no bfloat16)
        text = f.read().replace(
            'name: "HIDDEN_STATES", data_type: TYPE_FP32', 'name: "HIDDEN_STATES", data_type: TYPE_BF16'
        )
    with open(cfg, "w") as f:
        f.write(text)
    for name in ("llm", "llm_capped"):
        cfg = os.path.join(repo, name, "config.pbtxt")
        set_parameter(cfg, "model", smollm_dir)
        add_parameter(cfg, "kv_cache_max_bytes", str(512 << 20))  # several servers share 24 GiB
    for family, folder in (family_dirs or {}).items():
        cfg = copy_model(repo, f"llm_{family}", folder)
        set_parameter(cfg, "engine_process", "false")  # NOTE: one process fewer each
    cfg = copy_model(repo, "llm_spec", smollm_dir)  # NOTE: n-gram speculative decoding, in the stub
    set_parameter(cfg, "engine_process", "false")
    add_parameter(cfg, "speculative_method", "ngram")
    add_parameter(cfg, "num_speculative_tokens", "4")
    if eagle3:  # NOTE: an EAGLE-3 head's drafts, in the stub
        cfg = copy_model(repo, "llm_eagle3", eagle3[0])
        set_parameter(cfg, "engine_process", "false")
        for key, value in (("speculative_method", "eagle3"), ("num_speculative_tokens", "3"),
                           ("speculative_model", eagle3[1])):
            add_parameter(cfg, key, value)
    if tp_dir:  # NOTE: a tiny model over two ranks, in an engine process (small: CI's memory)
        set_parameter(copy_model(repo, "llm_tp2", tp_dir), "tensor_parallel_size", "2")
    return repo


def copy_model(repo: str, name: str, folder: str) -> str:
    """llm's config as `name` serving `folder`, small: returns its config.pbtxt."""
    shutil.copytree(os.path.join(REPO, "llm"), os.path.join(repo, name),
                    ignore=shutil.ignore_patterns("__pycache__"))
    cfg = os.path.join(repo, name, "config.pbtxt")
    with open(cfg) as f:
        text = f.read().replace('name: "llm"', f'name: "{name}"')
    with open(cfg, "w") as f:
        f.write(text)
    set_parameter(cfg, "model", folder)
    set_parameter(cfg, "max_num_seqs", "4")
    add_parameter(cfg, "kv_cache_max_bytes", str(32 << 20))
    return cfg


def add_parameter(config_path: str, key: str, value: str) -> None:
    with open(config_path) as f:
        text = f.read()
    entry = f'  {{ key: "{key}", value: {{ string_value: "{value}" }} }},\n'
    text = text.replace("parameters [\n", "parameters [\n" + entry, 1)
    with open(config_path, "w") as f:
        f.write(text)


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory, smollm_dir, tiny_model_dir, fp8_served_dir):
    root = str(tmp_path_factory.mktemp("triton"))
    served = {f: tiny_model_dir(f) for f in FAMILIES} | {"fp8": fp8_served_dir}
    llama = tiny_model_dir("llama")
    head = write_head(os.path.join(root, "eagle3-head"), llama, seed=2)
    repo = make_repository(root, smollm_dir, served, tp_dir=llama, eagle3=(llama, head))
    server = start_server(repo, log_path=os.path.join(root, "server.log"))
    try:
        server.wait_ready(timeout=600, models=("llm", "llm_sync", "llm_capped", "llm_sync_last", "hidden_classifier",
                                                   "llm_classifier", "llm_tp2", "llm_fp8", "llm_spec", "llm_eagle3", *(f"llm_{f}" for f in FAMILIES)))
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def fp8_served_dir(tiny_model_dir, tmp_path_factory):
    """The tiny Llama in compressed-tensors FP8 (per-channel weights, per-token activations):
    served as llm_fp8."""
    from fp8_checkpoints import write_fp8_copy

    return write_fp8_copy(tiny_model_dir("llama"), str(tmp_path_factory.mktemp("fp8-served")),
                          "channel", "token")


def pytest_collection_modifyitems(session, config, items):
    """The shutdown tests run after every other server test.

    NOTE: seen once here: after the server that test_shutdown.py stops had exited, the session's
    other tritonserver received a SIGTERM about a second later, while stub processes orphaned by
    earlier killed servers were still alive (pid reuse is the suspect). Not reproduced since
    the launcher kills each server's process group; the order keeps the suite safe either way.
    """
    items.sort(key=lambda item: item.fspath.basename == "test_shutdown.py")
