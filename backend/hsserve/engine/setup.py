"""Build what an Engine is made of from an EngineConfig: model, tokenizer, KV pool, scheduler."""

from __future__ import annotations

import gc
import logging
import os
from dataclasses import dataclass

import torch

from hsserve.engine.block_pool import BlockPool
from hsserve.engine.config import DEFAULT_MODEL, ConfigError, EngineConfig
from hsserve.engine.cuda_graphs import DecodeGraphs
from hsserve.engine.draft_graphs import DraftGraphs
from hsserve.engine.drafter import Eagle3Drafter
from hsserve.engine.executor import Executor
from hsserve.engine.hidden_rows import HiddenRows
from hsserve.engine.ranks import Ranks
from hsserve.kernels.topk import warm_topk
from hsserve.models.decoder import Decoder
from hsserve.models.default_model import ensure_default_model
from hsserve.models.eagle3 import load_head
from hsserve.models.loader import load_model
from hsserve.models.spec import ModelSpec
from hsserve.models.tensor_parallel import TensorParallel, local_spec
from hsserve.request import HiddenStatesMode
from hsserve.engine.scheduler import Scheduler
from hsserve.engine.speculative import Eagle3Proposer, NgramProposer

log = logging.getLogger(__name__)


@dataclass
class EngineParts:
    spec: ModelSpec
    model: Decoder
    tokenizer: object | None
    pool: BlockPool
    scheduler: Scheduler
    executor: Executor
    max_model_len: int
    max_prompt_tokens: int
    captured_layers: tuple[int, ...]  # normalized 0..L
    rows: HiddenRows


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def model_folder(config: EngineConfig) -> str:
    if config.model in ("", DEFAULT_MODEL):
        return ensure_default_model(config.cache_dir)
    if not os.path.exists(os.path.join(config.model, "config.json")):
        raise ConfigError(f"model: {config.model!r} is not a folder with config.json")
    return config.model


def freeze_heap() -> None:
    """Take what start-up allocated (torch, transformers, the tokenizer: millions of objects) out
    of the garbage collector's sight, as a serving process's last start-up step: its full
    collections, triggered by every step's short-lived objects, no longer walk all of it
    (bench/README.md#garbage-collector). Not for a process that starts and drops engines (a
    test run): what is frozen is never collected."""
    gc.collect()
    gc.freeze()


def load_tokenizer(folder: str):
    if not any(
        os.path.exists(os.path.join(folder, f)) for f in ("tokenizer.json", "tokenizer.model")
    ):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def num_kv_blocks(config: EngineConfig, spec: ModelSpec, dtype: torch.dtype, device, need: int,
                  extra_layers: int = 0) -> int:
    """Blocks from the memory budget, never more than `need` (enough for every sequence);
    extra_layers: K/V layers of the same shape beside the model's (an EAGLE-3 head's)."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    per_token = spec.kv_elems_per_token * (spec.num_layers + extra_layers) // spec.num_layers
    block_bytes = config.block_size * per_token * torch.finfo(dtype).bits // 8
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * config.kv_cache_memory_fraction)
    else:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        budget = min(config.kv_cache_max_bytes, int(available * config.kv_cache_memory_fraction))
    return max(1, min(need, budget // block_bytes))


def captured_layers(config: EngineConfig, spec: ModelSpec) -> tuple[int, ...]:
    if config.hidden_layers_captured is None:
        return tuple(range(spec.num_layers + 1))
    try:
        return tuple(sorted({spec.normalize_layer(k) for k in config.hidden_layers_captured}))
    except ValueError as e:
        raise ConfigError(f"hidden_layers_captured: {e}") from None


@dataclass
class Shard:
    """What every rank builds: the model (a rank's shard under tensor parallelism), its KV cache
    and the executor that runs steps on them."""

    model: Decoder
    executor: Executor
    max_model_len: int
    captured_layers: tuple[int, ...]  # normalized 0..L


def build_shard(config: EngineConfig, device: torch.device, folder: str,
                parallel: TensorParallel | None = None) -> Shard:
    tp = config.tensor_parallel_size
    if device.type == "cpu" and (config.num_threads or tp > 1):
        # NOTE: the ranks share the cores
        torch.set_num_threads(max(1, (config.num_threads or torch.get_num_threads()) // tp))
    model = load_model(folder, config.dtype, device, config.load_format, parallel,
                       config.quantization)
    spec = model.spec
    max_model_len = min(config.max_model_len or spec.max_position_embeddings, spec.max_position_embeddings)
    bs = config.block_size
    need = config.max_num_seqs * (-(-max_model_len // bs))
    head = None
    if config.speculative_method == "eagle3":  # NOTE: before the pool takes the memory left
        try:
            head = load_head(config.speculative_model, spec, model.embed)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    blocks = num_kv_blocks(config, spec, model.embed.dtype, device, need, int(head is not None))
    if parallel is not None:  # NOTE: what fits on every rank
        blocks = parallel.agree_min(blocks)
    if blocks * bs < max_model_len:
        log.warning("KV pool holds %d tokens: max_model_len lowered from %d", blocks * bs, max_model_len)
        max_model_len = blocks * bs
    # NOTE: zeroed so that masked-out keys of padding blocks are finite (0 x NaN would be NaN);
    # afterwards blocks only ever hold finite K/V. Written, not calloc'ed (torch.zeros): on the
    # CPU every page is then resident from the start, so memory does not creep up as blocks are
    # first used (and a leak shows as growth).
    kv_cache = torch.empty(
        spec.num_layers, 2, blocks, bs, spec.num_kv_heads, spec.head_dim,
        dtype=model.embed.dtype, device=device,
    ).zero_()
    log.info("model %s on %s (%s): %d KV blocks of %d tokens", folder, device, model.embed.dtype, blocks, bs)
    layers = captured_layers(config, spec)
    executor = Executor(model, kv_cache, bs, config.max_num_seqs)
    if head is not None:  # NOTE: its K/V in the target's blocks (engine/drafter.py)
        executor.drafter = Eagle3Drafter(head, torch.zeros_like(kv_cache[0]),
                                         config.num_speculative_tokens, executor.plan)
    if config.enable_cuda_graph and executor.plan.kernels:
        # NOTE: captured once for the ceiling and the captured layer set (and the head's)
        graph_layers = list(layers) if config.hidden_states_ceiling != HiddenStatesMode.NONE else []
        if head is not None:
            graph_layers = sorted(set(graph_layers) | set(head.spec.aux_layers))
        pages = -(-max_model_len // bs)
        executor.graphs = DecodeGraphs(model, kv_cache, graph_rows(config), pages, graph_layers)
        executor.graphs.capture()
        if head is not None:
            drafts = DraftGraphs(head, executor.drafter.kv, executor.graphs.max_batch, pages)
            drafts.capture()
            executor.drafter.graphs = drafts
    if device.type == "cuda" and config.max_logprobs:
        warm_topk(device, spec.vocab_size, config.max_logprobs)
    return Shard(model, executor, max_model_len, layers)


def graph_rows(config: EngineConfig) -> int:
    """The decode graphs' largest row count: a row per sequence, and with drafts room for
    verify steps of k + 1 rows a sequence (up to 256 rows: larger verify steps run eager)."""
    seqs = config.max_num_seqs
    if config.speculative_method == "none":
        return seqs
    return min(seqs * (config.num_speculative_tokens + 1), max(seqs, 256))


def proposer_for(config: EngineConfig) -> NgramProposer | Eagle3Proposer | None:
    if config.speculative_method == "none":
        return None
    if config.speculative_method == "eagle3":
        return Eagle3Proposer(config.num_speculative_tokens)
    return NgramProposer(config.num_speculative_tokens, *config.ngram_range)


def build_engine_parts(config: EngineConfig) -> EngineParts:
    device = resolve_device(config.device)
    folder = model_folder(config)
    ranks = None
    if config.tensor_parallel_size > 1:
        try:  # NOTE: refused before any rank starts
            local_spec(ModelSpec.from_folder(folder), config.tensor_parallel_size)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        ranks = Ranks(config, device, folder)
    try:
        shard = build_shard(config, ranks.devices[0] if ranks else device, folder,
                            ranks.parallel if ranks else None)
    except BaseException:
        if ranks is not None:
            ranks.close()
        raise
    shard.executor.peers = ranks
    spec, max_model_len = shard.model.spec, shard.max_model_len
    blocks = shard.executor.kv_cache.shape[2]
    pool = BlockPool(blocks, config.block_size, enable_caching=config.enable_prefix_caching)
    rows = HiddenRows(getattr(torch, config.hidden_dtype))
    return EngineParts(
        spec=spec,
        model=shard.model,
        tokenizer=load_tokenizer(folder),
        pool=pool,
        scheduler=Scheduler(pool, config.max_num_seqs, config.max_num_batched_tokens,
                            config.prefill_wait_ms, on_preempt=rows.preempted,
                            proposer=proposer_for(config)),
        executor=shard.executor,
        max_model_len=max_model_len,
        max_prompt_tokens=min(config.max_prompt_tokens or max_model_len, max_model_len),
        captured_layers=shard.captured_layers,
        rows=rows,
    )
