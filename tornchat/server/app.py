"""The Tornado application: the route table, the access log, and serve()."""
import asyncio
import logging
import signal

from tornado.httpserver import HTTPServer
from tornado.web import Application

from tornchat.config import Config
from tornchat.server import handlers
from tornchat.server.stats import ServerStats

log = logging.getLogger("tornchat.server")
access_log = logging.getLogger("tornchat.access")

ROUTES = [
    (r"/health", handlers.HealthHandler),
    (r"/v1/models", handlers.ModelsHandler),
    (r"/v1/models/([^/]+)", handlers.ModelHandler),
    (r"/v1/chat/completions", handlers.ChatCompletionsHandler),
]


def log_request(handler) -> None:
    """One line per request: method, path, status, tokens, time to first token, total time."""
    status = handler.get_status()
    handler.settings["server_stats"].count_response(status)
    request = handler.request
    usage = getattr(handler, "usage", None)
    first = getattr(handler, "first_token_at", None)
    ttft = f"{(first - request._start_time) * 1000:.1f}" if first else "-"
    access_log.info(
        "%s %s %d prompt_tokens=%s completion_tokens=%s ttft_ms=%s total_ms=%.1f",
        request.method,
        request.path,
        status,
        usage.prompt_tokens if usage else "-",
        usage.completion_tokens if usage else "-",
        ttft,
        request.request_time() * 1000,
    )


def make_app(config: Config, engine) -> Application:
    return Application(
        ROUTES,
        default_handler_class=handlers.NotFoundHandler,
        log_function=log_request,
        tornchat_config=config,
        engine=engine,
        server_stats=ServerStats(),
    )


def serve(config: Config, engine) -> None:
    """Listen until SIGINT or SIGTERM, then stop the engine."""

    async def main() -> None:
        app = make_app(config, engine)
        # Bodies past our own limit are answered with a JSON 413 by the
        # handler; Tornado's cap is only the hard stop for endless uploads.
        server = HTTPServer(app, max_body_size=2 * config.max_body_bytes + 65536)
        server.listen(config.port, config.host)
        log.info("listening on http://%s:%d", config.host, config.port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        await stop.wait()
        log.info("shutting down")
        server.stop()
        await server.close_all_connections()

    try:
        asyncio.run(main())
    finally:
        engine.close()
