"""The real server's /metrics count a known workload; an overload's excess is refused quickly.

Issue 7. Overload: the excess is refused ("queue is full") within 2 s; the admitted complete."""

from __future__ import annotations

import concurrent.futures
import re
import time
import urllib.request

from triton_helpers import GrpcStream, metrics

MODEL = "llm_capped"  # NOTE: its own labels; max_num_seqs 4 + max_queue_size 4


def wait_for(url, key, value, timeout=10.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = metrics(url, MODEL)
        if m.get(key, 0.0) >= value:
            return m
        time.sleep(0.1)
    return metrics(url, MODEL)


def buckets(url: str, name: str) -> dict[str, float]:
    """le -> cumulative count of one histogram of MODEL."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(f"{name}_bucket{{") and f'model="{MODEL}"' in line:
            out[re.search(r'le="([^"]+)"', line).group(1)] = float(line.rsplit(" ", 1)[1])
    return out


def test_metrics_count_a_known_workload(triton_server):
    url = f"http://127.0.0.1:{triton_server.ports.metrics}/metrics"
    before = metrics(url, MODEL)
    itl_before = buckets(url, "llm_inter_token_latency_seconds")
    prompts = [[100 + i] * (3 + 2 * i) for i in range(5)]
    new = [4, 6, 1, 8, 3]
    stream = GrpcStream(triton_server.grpc_url)
    for p, n in zip(prompts, new):
        stream.send(dict(input_ids=p, max_tokens=n, ignore_eos=True, temperature=0.0, stream=True),
                    model=MODEL)
        got = stream.read()
        assert got.error is None and len(got.cat("output_ids")) == n
    stream.close()
    gen = before.get("llm_generation_tokens_total", 0) + sum(new)
    after = wait_for(url, "llm_request_latency_seconds_count",
                     before.get("llm_request_latency_seconds_count", 0) + 5)
    delta = lambda k: after.get(k, 0.0) - before.get(k, 0.0)  # noqa: E731
    assert after["llm_generation_tokens_total"] == gen
    assert delta("llm_prompt_tokens_total") == sum(len(p) for p in prompts)
    assert delta("llm_time_to_first_token_seconds_count") == 5
    assert delta("llm_inter_token_latency_seconds_count") == sum(n - 1 for n in new)
    assert delta("llm_request_latency_seconds_count") == 5
    assert delta("llm_request_latency_seconds_sum") > 0
    assert delta("llm_prefix_cache_query_tokens_total") == sum(len(p) for p in prompts)
    assert after["llm_graph_captures_total"] == 0  # NOTE: CPU: no CUDA graphs
    assert after["llm_requests_running"] == 0 and after["llm_kv_blocks_in_use"] == 0
    assert after["llm_kv_blocks_total"] > 0
    # NOTE: the buckets are cumulative, +Inf holds every observation, and each token's gap
    # (under 2.5 s here) falls in a finite bucket
    itl = buckets(url, "llm_inter_token_latency_seconds")
    itl_delta = {le: itl[le] - itl_before.get(le, 0.0) for le in itl}
    finite = sorted((float(le), n) for le, n in itl_delta.items() if le != "+Inf")
    assert len(finite) == 11 and all(a[1] <= b[1] for a, b in zip(finite, finite[1:]))
    assert itl_delta["+Inf"] == finite[-1][1] == sum(n - 1 for n in new)


def test_overload_excess_gets_unavailable_quickly_and_admitted_complete(triton_server):
    url = triton_server.grpc_url

    def one(i):
        s = GrpcStream(url)
        t0 = time.perf_counter()
        s.send(dict(input_ids=[200 + i, 5, 6], max_tokens=30, ignore_eos=True, temperature=0.0,
                    stream=True), model=MODEL)
        got = s.read()
        dt = time.perf_counter() - t0
        s.close()
        return got, dt

    with concurrent.futures.ThreadPoolExecutor(32) as pool:  # 4x the 8 the model holds
        results = list(pool.map(one, range(32)))
    refused = [(g, dt) for g, dt in results if g.error is not None]
    served = [g for g, _ in results if g.error is None]
    assert len(refused) >= 8, len(refused)
    for g, dt in refused:
        assert "queue is full" in g.error.message() and dt < 2.0, (g.error.message(), dt)
    for g in served:
        assert len(g.cat("output_ids")) == 30
