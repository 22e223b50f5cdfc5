"""The Tornado application: the route table, the access log, and serve()."""
import asyncio
import gc
import logging
import re
import signal

from tornado.httpserver import HTTPServer
from tornado.ioloop import IOLoop
from tornado.web import Application

from tornchat.config import Config
from tornchat.engine.grammar import Compiler
from tornchat.server import handlers, messages, responses, web
from tornchat.server.mailbox import Mailbox
from tornchat.server.metrics import Metrics
from tornchat.server.stats import ServerStats

log = logging.getLogger("tornchat.server")
access_log = logging.getLogger("tornchat.access")

ROUTES = [
    (r"/health", handlers.HealthHandler),
    (r"/metrics", handlers.MetricsHandler),
    (r"/openapi.json", handlers.OpenAPIHandler),
    (r"/v1/models", handlers.ModelsHandler),
    (r"/v1/models/([^/]+)", handlers.ModelHandler),
    (r"/v1/chat/completions", handlers.ChatCompletionsHandler),
    (r"/v1/completions", handlers.CompletionsHandler),
    (r"/v1/responses", responses.ResponsesHandler),
    (r"/v1/messages", messages.MessagesHandler),
    (r"/v1/messages/count_tokens", messages.CountTokensHandler),
    (r"/", web.PageHandler),
    (r"/web/([^/]+)", web.AssetHandler),
]
WEB_HANDLERS = (web.PageHandler, web.AssetHandler)  # off with --no-web-ui
# Metric labels: the route, not the raw path, so that probing clients cannot
# grow the number of series.
ENDPOINTS = {handler: re.sub(r"\(.*?\)", "{id}", path) for path, handler in ROUTES}
SHUTDOWN_GRACE_S = 5.0  # requests in flight at SIGTERM get this long to finish; then they are cancelled


def log_request(handler) -> None:
    """One line per request: method, path, status, tokens, time to first token, total time."""
    status = handler.get_status()
    handler.settings["server_stats"].count_response(status)
    request = handler.request
    usage = getattr(handler, "usage", None)
    first = getattr(handler, "first_token_at", None)
    ttft = first - request._start_time if first else None
    handler.settings["metrics"].observe_response(ENDPOINTS.get(type(handler), "other"), status, usage, ttft)
    fields = {
        "method": request.method,
        "path": request.path,
        "status": status,
        "prompt_tokens": usage.prompt_tokens if usage else None,
        "completion_tokens": usage.completion_tokens if usage else None,
        "ttft_ms": round(ttft * 1000, 1) if ttft is not None else None,
        "total_ms": round(request.request_time() * 1000, 1),
    }
    access_log.info(
        "%s %s %d prompt_tokens=%s completion_tokens=%s ttft_ms=%s total_ms=%.1f",
        *(("-" if value is None else value) for value in fields.values()),
        extra=fields,  # separate keys in --log-format json
    )


def make_app(config: Config, engine) -> Application:
    server_stats = ServerStats()
    routes = [(path, handler) for path, handler in ROUTES if config.web_ui or handler not in WEB_HANDLERS]
    return Application(
        routes,
        default_handler_class=handlers.NotFoundHandler,
        log_function=log_request,
        tornchat_config=config,
        engine=engine,
        server_stats=server_stats,
        metrics=Metrics(engine, server_stats),
        grammars=Compiler(engine.tokenizer),  # structured outputs: its vocabulary built at the first grammar
        in_flight=set(),  # handlers with a generation submitted, for shutdown
        mailbox=Mailbox(IOLoop.current()),  # the engine's events onto this loop
        responses_store=responses.Store(config.responses_store),  # for previous_response_id
    )


async def drain(in_flight: set, grace: float) -> None:
    """Let requests in flight finish for up to grace seconds, then cancel the rest with a clear error."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace
    while in_flight and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if in_flight:
        log.warning("cancelling %d request(s) still in flight", len(in_flight))
        for handler in list(in_flight):
            handler.shut_down()
    # Each cancelled handler writes its last bytes on its next turn of the loop.
    deadline = loop.time() + 1.0
    while in_flight and loop.time() < deadline:
        await asyncio.sleep(0.01)


def serve(config: Config, engine) -> None:
    """Listen until SIGINT or SIGTERM; then stop accepting, drain, close connections, stop the engine."""

    async def main() -> None:
        app = make_app(config, engine)
        # What start-up built (modules, the tokenizer's tables, the model's records: ~220,000 objects) lives as
        # long as the server, yet every full collection walked it again: 90-120 ms with the GIL held, a stall
        # in every stream. Frozen, a full collection walks only what requests made since.
        gc.collect()
        gc.freeze()
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
        await drain(app.settings["in_flight"], SHUTDOWN_GRACE_S)
        await server.close_all_connections()

    try:
        asyncio.run(main())
    finally:
        engine.close()
        log.info("stopped")
