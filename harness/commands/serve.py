"""parity serve: the reference pipeline behind the OpenAI Images API, for gating and timing a served model end to end."""

from __future__ import annotations

import argparse

from harness.commands._options import add_device, add_json, device

HELP = "serve the reference pipeline over HTTP with the OpenAI Images API (POST /v1/images/generations)"
DESCRIPTION = """\
Serve parity's reference pipeline (models built once at start-up) on HOST:PORT with the OpenAI
Images API, as `sglang serve` serves a model: POST /v1/images/generations with prompt, size
(WxH), seed, num_inference_steps (or steps) and any other pipeline field; the answer holds one PNG
as b64_json and inference_time_s, and sglang's perf dump is written where perf_dump_path asks.
GET /health and GET /v1/models answer once it is ready. --slowdown F sleeps F x each generation's
time after it (reported as denoising time, the image unchanged): a server F slower end to end,
for an A/B to find. Runs until interrupted (Ctrl-C, SIGTERM).

  parity serve --port 8000 &
  parity gate --pipeline-target openai --pipeline-target-arg url=http://127.0.0.1:8000
  parity perf openai openai --base-arg launch='parity serve --port {port}' \\
                            --head-arg launch='parity serve --port {port} --slowdown 0.2'"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "serve", help=HELP, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: loopback)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: any free port)")
    parser.add_argument("--weights", default="tiny-v1", help="checkpoint the models load (default tiny-v1)")
    parser.add_argument("--dtype", default="float32", help="the models' dtype (default float32)")
    parser.add_argument(
        "--slowdown",
        type=float,
        default=0.0,
        metavar="F",
        help="sleep F x each generation's time after it: F slower end to end (default 0)",
    )
    add_device(parser)
    add_json(parser, "where it listens ({url, host, port, pid}, once ready: a script's way to learn --port 0's pick)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from harness.errors import ConfigError
    from harness.targets.reference.server import ImagesServer, ServedPipeline, base_config

    if not 0.0 <= args.slowdown <= 100.0:
        raise ConfigError(f"must be in [0, 100], got {args.slowdown}", key="--slowdown")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"must be in [0, 65535], got {args.port}", key="--port")
    base = base_config(weights=args.weights, dtype=args.dtype, device=device(args))
    try:
        server = ImagesServer((args.host, args.port), ServedPipeline.build(base, args.slowdown))
    except OSError as exc:
        raise ConfigError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", key="--port") from None
    with server:
        host, port = server.server_address[:2]
        print(
            f"parity serve: ready on http://{host}:{port} (models: {args.weights}, {args.dtype}, {base.device})",
            flush=True,
        )
        server.serve_forever(poll_interval=0.2)
    return 0
