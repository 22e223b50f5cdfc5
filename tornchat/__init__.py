"""tornchat: a low-latency, single-user, OpenAI-compatible chat-completion server."""

MODEL_ID = "gpt-3.5-turbo"
__version__ = "0.1.0"
