"""Command line: `hsserve prepare` (convert the default model, build the CPU kernels),
`hsserve generate` (one prompt), `hsserve serve` (tritonserver), `hsserve openai` (the
OpenAI-compatible gateway over it), `hsserve extract` (a dataset's hidden states)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys


def _prepare(args) -> int:
    from hsserve.kernels import cpu_ops
    from hsserve.models.default_model import ensure_default_model

    print(ensure_default_model(args.cache_dir))
    try:  # NOTE: built now, so no server's first CPU request waits for the compiler
        print(cpu_ops.build(), file=sys.stderr)
    except RuntimeError as e:
        print(f"CPU kernels not built (the torch path will run): {e}", file=sys.stderr)
    return 0


def _generate(args) -> int:
    from hsserve import Engine, EngineConfig, GenerationRequest, HiddenStatesMode, SamplingParams

    engine = Engine(EngineConfig(model=args.model, device=args.device)).start()
    try:
        req = GenerationRequest(
            "cli",
            prompt=args.prompt,
            sampling=SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature),
            hidden_mode=HiddenStatesMode.parse(args.mode),
            hidden_layers=tuple(args.layers) if args.mode != "none" else None,
        )
        for delta in engine.submit(req):
            sys.stdout.write(delta.text)
            sys.stdout.flush()
            if delta.request_done:
                res = {"finish_reason": delta.finish_reason.value,
                       "num_output_tokens": delta.num_output_tokens}
                print("\n" + json.dumps(res))
    finally:
        engine.shutdown()
    return 0


def _extract(args) -> int:
    from hsserve.extract.run import main

    return main(args)


def _serve(args) -> int:
    import signal

    from hsserve.triton.server import ADMIN_HEADER, ADMIN_KEY_ENV, Ports, start_server

    ports = Ports(args.http_port, args.grpc_port, args.metrics_port)
    server = start_server(args.model_repository, ports, extra_args=args.triton_arg)
    print(f"tritonserver starting (pid {server.process.pid}) on {args.model_repository}", flush=True)
    if server.admin_key and not os.environ.get(ADMIN_KEY_ENV):
        print(f"repository, shared-memory, trace and logging APIs need the header {ADMIN_HEADER}: "
              f"{server.admin_key} (set {ADMIN_KEY_ENV} to choose it)", flush=True)
    gateway = None
    try:
        server.wait_ready(timeout=args.ready_timeout, models=tuple(args.wait_for))
        if args.openai:
            gateway = _start_gateway(args)
        print(
            f"ready: HTTP http://127.0.0.1:{ports.http}  gRPC 127.0.0.1:{ports.grpc}  "
            f"metrics http://127.0.0.1:{ports.metrics}/metrics"
            + (f"  OpenAI http://127.0.0.1:{args.openai_port}/v1" if gateway else "")
            + "  (Ctrl-C stops)", flush=True,
        )
        # NOTE: explicit handlers: a shell starts background jobs with SIGINT ignored
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt))
        return server.process.wait()
    except KeyboardInterrupt:
        print("stopping tritonserver", flush=True)
        return 0
    finally:
        if gateway is not None:
            gateway.terminate()
            gateway.wait(timeout=30)
        server.stop()


def _start_gateway(args):
    """`hsserve openai` beside the server (serve --openai), on the server's gRPC port."""
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-m", "hsserve.cli", "openai", "--port",
                             str(args.openai_port), "--grpc-url", f"127.0.0.1:{args.grpc_port}",
                             "--model-repository", args.model_repository])


def _openai(args) -> int:
    from hsserve.gateway.main import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="hsserve")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="convert the default model once; print its folder")
    p.add_argument("--cache-dir", default="")
    p.set_defaults(fn=_prepare)
    g = sub.add_parser("generate", help="run one prompt through the engine, streaming text")
    g.add_argument("prompt")
    g.add_argument("--model", default="default")
    g.add_argument("--device", default="auto")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--mode", default="none")
    g.add_argument("--layers", type=int, nargs="+", default=[-1])
    g.set_defaults(fn=_generate)
    x = sub.add_parser("extract", help="hidden states of a JSONL dataset into sharded safetensors")
    from hsserve.extract.run import add_arguments

    add_arguments(x)
    x.set_defaults(fn=_extract)
    s = sub.add_parser("serve", help="start tritonserver on the model repository")
    s.add_argument("--model-repository", default="model_repository")
    s.add_argument("--http-port", type=int, default=8000)
    s.add_argument("--grpc-port", type=int, default=8001)
    s.add_argument("--metrics-port", type=int, default=8002)
    s.add_argument("--ready-timeout", type=float, default=600)
    s.add_argument("--wait-for", nargs="+", default=["llm", "llm_sync"])
    s.add_argument("--triton-arg", action="append", default=[],
                   help="extra tritonserver flag, e.g. --triton-arg=--log-verbose=1")
    s.add_argument("--openai", action="store_true",
                   help="also serve the OpenAI API (hsserve openai) on --openai-port")
    s.add_argument("--openai-port", type=int, default=9000)
    s.set_defaults(fn=_serve)
    o = sub.add_parser("openai", help="an OpenAI-compatible API over a running tritonserver")
    from hsserve.gateway.main import add_arguments as openai_arguments

    openai_arguments(o)
    o.set_defaults(fn=_openai)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
