"""The decode engine: model forward, KV slots, sampling, stop checks, worker thread.

Nothing here knows about HTTP; the server submits GenerationRequests and
receives Events.
"""
from tornchat.engine.types import Event, GenerationRequest, PromptTooLong, QueueFull, SamplingParams, Usage
from tornchat.engine.worker import Engine, EngineStats, Handle

__all__ = [
    "Engine",
    "EngineStats",
    "Event",
    "GenerationRequest",
    "Handle",
    "PromptTooLong",
    "QueueFull",
    "SamplingParams",
    "Usage",
]
