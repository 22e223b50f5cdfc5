"""Request handlers. Cross-cutting checks (auth, CORS) live in BaseHandler.prepare;
every error is raised as an HTTPError and rendered by the one write_error.
"""
import copy
import dataclasses
import logging
import time
from dataclasses import dataclass

import jinja2
import orjson
from tornado.iostream import StreamClosedError
from tornado.queues import Queue
from tornado.web import HTTPError, RequestHandler, stream_request_body

from tornchat import MODEL_ID, functions, prompt, reasoning
from tornchat.engine.grammar import Grammar, GrammarError
from tornchat.engine.types import Event, GenerationRequest, PromptTooLong, QueueFull, Usage
from tornchat.engine.worker import Handle
from tornchat.functions import Piece
from tornchat.kernels.stopcheck import spellings
from tornchat.server import auth, openapi, replies, sse, stats, validate
from tornchat.server.errors import APIError, invalid
from tornchat.server.validate import SEED_MODULUS

log = logging.getLogger("tornchat.server")

STATUS_DETAILS = {404: "Not found", 405: "Method not allowed"}
BUSY = "Server busy: too many requests are waiting; retry shortly"


class ShuttingDown(Exception):
    """Ends a generation still running when the server stops (SIGTERM)."""


def failure(error: BaseException) -> tuple[int, str]:
    """Status and client-visible message for a generation that failed; never the error's own text."""
    if isinstance(error, MemoryError):  # the engine reports device OOM as MemoryError
        return 503, "The device ran out of memory during generation; the request was dropped. Retry, or send a shorter conversation"
    if isinstance(error, ShuttingDown):
        return 503, "Server shutting down; retry shortly"
    if isinstance(error, QueueFull):  # a later choice of n found the queue full
        return 503, BUSY
    return 500, "Internal server error"


@dataclass
class ChoiceState:
    """One of a request's n choices: its own generation, reply and parser state."""

    index: int
    generation: GenerationRequest
    reply: object  # replies.Reply, TextReply or an agents.EventReply
    parser: object  # None: all the text is content
    handle: Handle | None = None  # None: not submitted yet
    last: Event | None = None  # its last event, once the handler has taken it

    @property
    def running(self) -> bool:
        return self.handle is not None and self.last is None


def choices(generation: GenerationRequest, n: int, reply, parser) -> list[ChoiceState]:
    """n choices of one prompt. Choice i samples with the request's seed + i (choice 0 as the request alone
    would), or its own random seed where the request gives none; reply(index, first) makes each reply.
    The grammar and the parser keep a generation's position, so each choice has its own: copies made
    before any token, which are fresh ones."""
    first = reply(0, None)
    made = [ChoiceState(0, generation, first, parser)]
    seed = generation.sampling.seed
    for index in range(1, n):
        own = dataclasses.replace(
            generation,
            sampling=dataclasses.replace(generation.sampling, seed=None if seed is None else (seed + index) % SEED_MODULUS),
            grammar=generation.grammar.copy() if generation.grammar is not None else None,
        )
        made.append(ChoiceState(index, own, reply(index, first), copy.deepcopy(parser)))
    return made


class BaseHandler(RequestHandler):
    open_access = False  # True: no credentials needed (health checks)

    @property
    def config(self):
        return self.settings["tornchat_config"]

    @property
    def engine(self):
        return self.settings["engine"]

    @property
    def server_stats(self) -> stats.ServerStats:
        return self.settings["server_stats"]

    def set_default_headers(self) -> None:
        origin = self.settings["tornchat_config"].cors_origin
        if origin:
            self.set_header("Access-Control-Allow-Origin", origin)
            if origin != "*":
                self.set_header("Vary", "Origin")

    def prepare(self) -> None:
        # A CORS preflight carries no credentials by design.
        if self.request.method == "OPTIONS" or self.open_access:
            return
        if not self.authorized():
            raise APIError(401, "Invalid or missing credentials")

    def authorized(self) -> bool:
        """Whether the request carries the configured credentials; an API with its own key header extends this."""
        return auth.authorized(self.config, self.request.headers.get("Authorization"))

    def options(self, *args) -> None:
        if not self.config.cors_origin:
            raise HTTPError(405)
        self.set_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
        requested = self.request.headers.get("Access-Control-Request-Headers")
        self.set_header("Access-Control-Allow-Headers", requested or "Authorization, Content-Type")
        self.set_header("Access-Control-Max-Age", "600")
        self.set_status(204)

    def write_json(self, payload: dict) -> None:
        self.set_header("Content-Type", "application/json")
        self.write(orjson.dumps(payload))

    def write_error(self, status_code: int, **kwargs) -> None:
        error = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(error, APIError):
            detail = error.detail
            for name, value in error.headers.items():
                self.set_header(name, value)
        elif isinstance(error, HTTPError) and status_code < 500:
            detail = STATUS_DETAILS.get(status_code, self._reason)
        else:
            detail = "Internal server error"  # Tornado has logged the traceback
        if status_code == 401:
            for challenge in auth.challenges(self.config):
                self.add_header("WWW-Authenticate", challenge)
        self.write_json(self.error_body(status_code, detail, getattr(error, "code", None)))

    def error_body(self, status_code: int, detail: str, code: str | None) -> dict:
        """The JSON of an error reply; the agents' APIs answer in their own shapes."""
        return {"detail": detail}


class NotFoundHandler(BaseHandler):
    def prepare(self) -> None:
        raise HTTPError(404)


class HealthHandler(BaseHandler):
    open_access = True

    def get(self) -> None:
        self.write_json(stats.snapshot(self.engine, self.server_stats))


class MetricsHandler(BaseHandler):
    """Prometheus exposition. Behind the credentials when auth is on: it shows traffic volumes."""

    def get(self) -> None:
        body, content_type = self.settings["metrics"].render(self.request.headers.get("Accept", ""))
        self.set_header("Content-Type", content_type)
        self.write(body)


class OpenAPIHandler(BaseHandler):
    open_access = True  # the API's shape is public; it names no model and no path

    def get(self) -> None:
        self.write_json(openapi.document(self.config))


class ModelsHandler(BaseHandler):
    def get(self) -> None:
        self.write_json({"object": "list", "data": [replies.model_card()]})


class ModelHandler(BaseHandler):
    def get(self, model_id: str) -> None:
        if model_id != MODEL_ID:
            raise APIError(404, f"Model {model_id!r} not found")
        self.write_json(replies.model_card())


@stream_request_body
class GenerationHandler(BaseHandler):
    """What the generating endpoints share: read the body, queue on the engine, answer as JSON or SSE.

    The body streams in so that an oversized one is refused without holding
    it all. Engine events arrive from the worker thread through the
    server's mailbox (``mailbox``: one IOLoop wake-up for a step's events)
    into a Queue; a client that leaves withdraws its
    request from the engine. Subclasses turn the body into a
    GenerationRequest and a reply (replies.Reply or TextReply) in ``post``,
    one per choice where the request asks for n.
    """

    def prepare(self) -> None:
        super().prepare()
        self.choices: list[ChoiceState] = []
        self.ended = False  # withdrawn (client gone, shutdown, handler done): submit no more choices
        self.usage = None  # for the access log
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.body_size = 0
        self.chunks: list[bytes] = []
        declared = self.request.headers.get("Content-Length", "")
        if declared.isdigit() and int(declared) > self.config.max_body_bytes:
            raise self._too_large(int(declared))

    def data_received(self, chunk: bytes) -> None:
        self.body_size += len(chunk)
        if self.body_size <= self.config.max_body_bytes:
            self.chunks.append(chunk)

    def _too_large(self, size: int) -> APIError:
        return invalid(f"body is {size} bytes; the limit is {self.config.max_body_bytes} (max_body_bytes)", 413)

    def body(self) -> dict:
        if self.body_size > self.config.max_body_bytes:
            raise self._too_large(self.body_size)
        data = validate.parse_body(b"".join(self.chunks))
        if data.get("temperature") is None and self.config.temperature_default is not None:
            data["temperature"] = self.config.temperature_default  # the server's default; every API reads this key
        return data

    @property
    def vocab_size(self) -> int:
        return len(self.engine.tokenizer)

    def spelling(self, request: validate.Request) -> tuple[bytes, ...] | None:
        """The bytes of each token id where the request asked for logprobs, else None."""
        return spellings(self.engine.tokenizer) if request.logprobs is not None else None

    def _prediction_ids(self, request: validate.Request) -> list[int]:
        """The prediction's tokens, drafted from where speculation is on (and ignored where it is off)."""
        if not request.prediction:
            return []
        return self.engine.tokenizer(request.prediction, add_special_tokens=False)["input_ids"]

    async def generate(self, choices: list[ChoiceState], request: validate.Request) -> None:
        """Generate every choice; only choice 0 is submitted here (``_events`` submits the rest)."""
        self.events: Queue[tuple[ChoiceState, Event] | None] = Queue()
        self.choices = choices
        try:
            self._submit(choices[0])
        except PromptTooLong as exc:
            raise self.too_long(exc) from None
        except QueueFull:
            raise APIError(503, BUSY, {"Retry-After": "1"}) from None
        self.settings["metrics"].observe_options(choices[0].generation)
        in_flight = self.settings["in_flight"]
        in_flight.add(self)
        try:
            if request.stream:
                await self._stream(choices, request.include_usage)
            else:
                await self._complete(choices)
        finally:
            in_flight.discard(self)

    def _submit(self, choice: ChoiceState) -> None:
        mailbox = self.settings["mailbox"]
        choice.handle = self.engine.submit(choice.generation, lambda event: mailbox.post(self.events.put_nowait, (choice, event)))

    def _submit_later(self, choice: ChoiceState) -> None:
        """Submit a choice after choice 0; a full queue fails that choice as a generation failure would."""
        try:
            self._submit(choice)
        except QueueFull as exc:
            # A handle the engine never saw: the choice counts as submitted, and its failure comes as any other.
            choice.handle = Handle(choice.generation, lambda event: None)
            self.events.put_nowait((choice, Event(error=exc)))

    def done(self) -> bool:
        """Every choice has had its last event."""
        return all(choice.last is not None for choice in self.choices)

    def usage_of_all(self) -> Usage:
        return replies.total_usage([choice.last.usage for choice in self.choices])

    def too_long(self, exc: PromptTooLong) -> APIError:
        """The error for a prompt that leaves no room for a reply; it names the prompt's tokens and the context."""
        return invalid(str(exc))

    def chat_generation(self, request: validate.ChatRequest) -> tuple[GenerationRequest, object]:
        """The engine request and the reply parser for a chat-shaped request.

        Every chat-like API (chat completions, Responses, Messages) maps its
        body onto a ChatRequest and comes through here, so the same
        conversation renders to the same tokens whichever API carries it,
        and a KV slot filled by one turn serves the next.
        """
        tokenizer = self.engine.tokenizer
        plan, thinks, enabled = self.plan(request)
        budget = reasoning.tighter(self.config.reasoning_budget, request.thinking.budget)
        thinking = reasoning.thinking(plan.prompt, thinks, enabled, budget)
        generation = GenerationRequest(
            prompt_ids=prompt.encode(tokenizer, plan.prompt),
            sampling=request.sampling,
            max_tokens=request.max_tokens if request.max_tokens is not None else self.config.max_tokens_default,
            max_length=request.max_length,
            stop=request.stop + plan.stops,
            logprobs=request.logprobs,
            grammar=self._grammar(plan.grammar),
            prediction_ids=self._prediction_ids(request),
            keep_special=plan.keep,
            thinking=thinking,
        )
        return generation, reasoning.Parser(thinking, plan.parser) if thinking is not None else plan.parser

    def plan(self, request: validate.ChatRequest) -> tuple[functions.Plan, bool, bool]:
        """The request's plan, whether the template thinks, and whether this reply may think."""
        tokenizer = self.engine.tokenizer
        thinks = reasoning.template_thinks(tokenizer)
        enabled = request.thinking.enabled
        if enabled is None:
            enabled = self.config.reasoning == "on"
        # A grammar that binds the reply from its first token (JSON, a forced call) leaves no room for thinking.
        enabled = enabled and not (request.response_format.json or request.choice.mode in ("named", "required"))
        kwargs = reasoning.template_kwargs(thinks, enabled, request.template_kwargs)
        try:
            plan = functions.plan(tokenizer, request.messages, request.functions, request.choice, request.response_format, kwargs)
        except jinja2.TemplateSyntaxError:
            raise  # the checkpoint's template is broken: a server error
        except jinja2.TemplateError as exc:  # it refuses these messages (roles out of order, say)
            raise invalid(f"messages: the model's chat template refuses them: {exc}") from None
        return plan, thinks, enabled

    def _grammar(self, lark: str | None) -> Grammar | None:
        if lark is None:
            return None
        try:
            return self.settings["grammars"].compile(lark)
        except GrammarError as exc:  # each schema compiled alone (validate); together they should too
            raise invalid(f"functions / response_format: the schemas cannot be enforced together: {exc}") from None

    async def _complete(self, choices: list[ChoiceState]) -> None:
        async for choice, event in self._events():
            if event.error is not None:
                status, message = failure(event.error)  # the engine has logged it
                raise APIError(status, message, {"Retry-After": "1"} if status == 503 else None)
            choice.reply.add_logprobs(event.logprobs)
            for piece in _pieces(choice.parser, event):
                choice.reply.add(piece)
            if self.done():
                self.usage = self.usage_of_all()
                self.write_json(replies.completion([(c.reply, c.last.finish_reason) for c in choices], self.usage))

    async def _stream(self, choices: list[ChoiceState], include_usage: bool) -> None:
        self.server_stats.counters["streams"] += 1
        self.set_header("Content-Type", "text/event-stream; charset=utf-8")
        self.set_header("Cache-Control", "no-cache")
        # The opening records (or at least the headers) go out now, before the first token.
        if not await self._send(b"".join(sse.record(chunk) for choice in choices for chunk in choice.reply.opening())):
            return
        finished = 0
        try:
            async for batch in self._batches():
                records = []
                for choice, event in batch:
                    reply = choice.reply
                    if event.error is not None:
                        status, message = failure(event.error)
                        records.append(sse.error_record("Generation failed" if status == 500 else message, "server_error"))
                        await self._send(b"".join(records) + sse.DONE)
                        return
                    reply.add_logprobs(event.logprobs)  # sent with the next chunk
                    records += [sse.record(reply.chunk(delta)) for p in _pieces(choice.parser, event) if (delta := reply.add(p))]
                    if event.is_last:
                        finished += 1
                        records.append(sse.record(reply.chunk({}, reply.finish_reason(event.finish_reason))))
                    if finished == len(choices):  # counted here: a batch's choices are all marked done before it is read
                        self.usage = self.usage_of_all()
                        if include_usage:
                            records.append(sse.record(reply.usage_chunk(self.usage)))
                        records.append(sse.DONE)
                if records and not await self._send(b"".join(records)):
                    return
        except Exception:
            log.exception("stream failed")
            await self._send(sse.error_record("Internal server error", "server_error") + sse.DONE)

    async def _events(self):
        """(choice, event) for this request's choices as they come, until every choice has had its last
        event or the client leaves. Choices after the first are submitted once choice 0 sends its first
        event: its prompt is then in its KV slot, which they fork instead of prefilling the prompt again."""
        inter_token = self.settings["metrics"].inter_token
        while (item := await self.events.get()) is not None:
            choice, event = item
            if not self.ended:
                for later in self.choices:
                    if later.handle is None:
                        self._submit_later(later)
            if event.text:
                now = time.time()
                if self.last_token_at is None:
                    self.first_token_at = now
                else:
                    inter_token.observe(now - self.last_token_at)
                self.last_token_at = now
            if event.is_last:
                choice.last = event
            yield choice, event
            if self.done():
                return

    async def _batches(self):
        """``_events`` in lists: one event, with those that arrived while the last write was being flushed.
        At hundreds of tokens a second (a GPU) a write per token would fall behind the engine; this way one
        write carries whatever is waiting, and a client that keeps up still gets each token as it comes."""
        batch = []
        async for choice, event in self._events():
            batch.append((choice, event))
            if self.done() or self.events.empty():
                yield batch
                batch = []

    async def _send(self, data: bytes) -> bool:
        """Write and flush; False (and the generation withdrawn) if the client has gone."""
        try:
            self.write(data)
            await self.flush()
            return True
        except StreamClosedError:
            self._withdraw()
            return False

    def _cancel(self) -> bool:
        """Withdraw every choice still generating, and submit no more; whether any was generating."""
        if self.ended or not any(choice.running for choice in self.choices):
            return False
        self.ended = True
        for choice in self.choices:
            if choice.running:
                self.engine.withdraw(choice.handle)
        return True

    def _withdraw(self) -> None:
        if self._cancel():
            self.server_stats.counters["client_disconnects"] += 1
            self.events.put_nowait(None)

    def shut_down(self) -> None:
        """The server is stopping: cancel the generation and answer with a 503 or a stream error record."""
        if self._cancel():
            self.events.put_nowait((self.choices[0], Event(error=ShuttingDown())))

    def on_connection_close(self) -> None:
        if getattr(self, "choices", None):
            self._withdraw()

    def on_finish(self) -> None:
        # A handler that ends early for any reason must not leave its generations running.
        if getattr(self, "choices", None):
            self._cancel()


class ChatCompletionsHandler(GenerationHandler):
    """POST /v1/chat/completions: messages through the chat template (and function prompts)."""

    async def post(self) -> None:
        request = validate.chat_request(self.body(), self.config.max_messages, self.vocab_size)
        generation, parser = self.chat_generation(request)
        spelling = self.spelling(request)
        reply = lambda index, first: replies.Reply(request.call_style, spelling, index, first)  # noqa: E731
        await self.generate(choices(generation, request.n, reply, parser), request)


class CompletionsHandler(GenerationHandler):
    """POST /v1/completions (legacy): the prompt as it is, no chat template; the reply is the text that follows."""

    async def post(self) -> None:
        request = validate.completion_request(self.body(), self.vocab_size)
        ids = request.prompt if isinstance(request.prompt, list) else prompt.encode(self.engine.tokenizer, request.prompt)
        if not ids:
            raise invalid("prompt is empty")
        generation = GenerationRequest(
            prompt_ids=ids, sampling=request.sampling, max_tokens=request.max_tokens, stop=request.stop,
            logprobs=request.logprobs, prediction_ids=self._prediction_ids(request),
        )
        spelling = self.spelling(request)
        await self.generate(choices(generation, request.n, lambda index, first: replies.TextReply(spelling, index, first), None), request)


def _pieces(parser, event: Event) -> list[Piece]:
    if parser is None:
        return [Piece("content", event.text)] if event.text else []
    pieces = parser.push(event.text) if event.text else []
    return pieces + parser.finish() if event.finish_reason else pieces
