"""`hsserve openai`: the gateway's command line (uvicorn serving app.create_app)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

log = logging.getLogger("hsserve.gateway")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--grpc-url", default="127.0.0.1:8001", help="tritonserver's gRPC endpoint")
    p.add_argument("--triton-model", default="llm", help="the decoupled model it streams from")
    p.add_argument("--model-repository", default="model_repository",
                   help="where --triton-model's config.pbtxt names the served folder")
    p.add_argument("--tokenizer", default="",
                   help="the served HF folder (default: the one --triton-model serves)")
    p.add_argument("--served-model-name", nargs="+", default=[],
                   help="names /v1/models lists and requests use (default: the folder's name "
                        "and the Triton model's)")


def run(args) -> int:
    import uvicorn

    from hsserve.gateway.app import Gateway, create_app
    from hsserve.gateway.backend import TritonBackend
    from hsserve.gateway.prompts import Prompts, model_folder

    folder = args.tokenizer or model_folder(args.model_repository, args.triton_model)
    names = args.served_model_name or [os.path.basename(os.path.normpath(folder)),
                                       args.triton_model]
    prompts = Prompts(folder)

    async def serve() -> None:
        # NOTE: the gRPC channel belongs to the event loop uvicorn runs
        gw = Gateway(TritonBackend(args.grpc_url, args.triton_model), prompts, names)
        config = uvicorn.Config(create_app(gw), host=args.host, port=args.port,
                                log_level="warning", access_log=False)
        log.info("OpenAI API on http://%s:%d/v1 (models %s) over %s", args.host, args.port,
                 names, args.grpc_url)
        try:
            await uvicorn.Server(config).serve()
        finally:
            await gw.backend.close()

    asyncio.run(serve())
    return 0
