"""Command line: ``tornchat serve`` (also ``python -m tornchat``)."""
import argparse
import dataclasses
import sys

from tornchat import checkpoint
from tornchat import config as config_module
from tornchat.server import logs


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tornchat", description="OpenAI-compatible chat-completion server")
    sub = p.add_subparsers(dest="command")
    serve = sub.add_parser("serve", help="start the HTTP server (the default command)")
    add_serve_flags(serve)
    return p


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    # Every flag defaults to None so that "not given" lets the config file decide.
    p.add_argument("--config", help="YAML file of settings (see configs/default.yaml); flags override it")
    p.add_argument("--checkpoint-path", help="HF model directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to bind (default 8000)")
    p.add_argument("--device", choices=config_module.CHOICES["device"], help="where the model runs (default auto)")
    p.add_argument("--dtype", choices=config_module.CHOICES["dtype"], help="weight dtype (default float32)")
    p.add_argument("--threads", type=int, help="torch threads; 0 = one per core (default 0)")
    p.add_argument("--model-impl", choices=config_module.CHOICES["model_impl"],
                   help="forward: lean for Llama/Qwen2/Mistral, transformers' modules otherwise (default auto)")
    p.add_argument("--quantize", choices=config_module.CHOICES["quantize"],
                   help="the weights' blocks (lean forward): auto keeps a GGUF's own and float weights as they are; "
                        "int4 (Q4_1), int8 (Q8_0), bf16 or none (F32) quantize into those at load (default auto)")
    p.add_argument("--speculate", choices=config_module.CHOICES["speculate"],
                   help="lookup: draft tokens from the conversation (and a request's prediction) and verify them in "
                        "one forward, same text; auto: on where this machine's verify cost makes it pay; none: "
                        "one token per forward (default auto)")
    p.add_argument("--kv-slots", type=int, help="conversations whose KV cache is kept (default 4)")
    p.add_argument("--kv-memory-mb", type=int, help="memory bound on all KV slots together (default 2048)")
    p.add_argument("--parallel", type=int, metavar="N",
                   help="requests decoded together, each step one forward over all their rows; each gets the reply it "
                        "would get alone (default 4)")
    p.add_argument("--max-queue", type=int, help="requests allowed to wait; beyond that 503 (default 16)")
    p.add_argument("--max-body-bytes", type=int, help="largest request body accepted (default 4 MiB)")
    p.add_argument("--max-messages", type=int, help="most messages in one request (default 1024)")
    p.add_argument("--max-tokens-default", type=int, metavar="N",
                   help="new tokens at most in a chat completion or a response whose request sets no max_tokens / "
                        "max_output_tokens (default: until the model stops or the context is full)")
    p.add_argument("--temperature-default", type=float, metavar="T",
                   help="temperature of a request that sets none, on every endpoint (default 1.0; below 0.01: greedy)")
    p.add_argument("--reasoning", choices=config_module.CHOICES["reasoning"],
                   help="thinking models (a chat template with <think>): on returns the thinking apart as "
                        "reasoning_content; off renders the template with enable_thinking=false; a request may "
                        "choose either (default on)")
    p.add_argument("--reasoning-budget", type=int,
                   help="most thinking tokens per reply: past them the server closes the thinking (</think>) and the "
                        "model answers; a request's reasoning_budget may only lower it (default: no cap)")
    p.add_argument("--responses-store", type=int,
                   help="responses kept in memory for /v1/responses' previous_response_id; 0: none (default 256)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY'")
    p.add_argument("--api-auth", help="require HTTP Basic credentials user:password")
    p.add_argument("--cors-origin", help="allowed CORS origin, e.g. '*' (default: CORS off)")
    p.add_argument("--no-web-ui", dest="web_ui", action="store_const", const=False,
                   help="do not serve the chat page at GET / (default: served)")
    p.add_argument("--log-level", choices=config_module.CHOICES["log_level"], help="default info")
    p.add_argument("--log-format", choices=config_module.CHOICES["log_format"], help="json: one JSON object per line (default text)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        argv = ["serve", *argv]
    args = parser().parse_args(argv)
    if args.command != "serve":
        parser().print_help()
        return 2
    overrides = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(config_module.Config)}
    try:
        config = config_module.build(args.config, overrides)
    except (OSError, ValueError, TypeError) as exc:
        print(f"tornchat: bad configuration: {exc}", file=sys.stderr)
        return 2
    logs.configure(config.log_level, config.log_format)
    # before the imports below (torch's 1.2-1.4 s), which the weights' read then overlaps
    checkpoint.start_reading(config.checkpoint_path, config.device, config.model_impl, config.quantize)
    from tornchat.build import build_engine
    from tornchat.server.app import serve

    try:
        engine = build_engine(config)
    except checkpoint.CheckpointError as exc:
        print(f"tornchat: {exc}", file=sys.stderr)
        return 1
    serve(config, engine)
    return 0
