"""Server-Sent Events framing: one ``data:`` record per JSON object, then ``[DONE]``."""
import orjson

DONE = b"data: [DONE]\n\n"


def record(payload: dict) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def error_record(message: str, kind: str) -> bytes:
    """An error after the stream has started; OpenAI clients raise it as an APIError."""
    return record({"error": {"message": message, "type": kind}})


def event(name: str, payload: dict) -> bytes:
    """A record with an ``event:`` line, as the Responses and Messages APIs frame theirs."""
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"
