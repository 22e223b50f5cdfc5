"""Server settings: defaults, overridden by a YAML file, overridden by flags."""
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml


@dataclass
class Config:
    checkpoint_path: str | None = None  # HF directory or .gguf; None: embedded SmolLM2-135M-Instruct
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "float32"  # float32 | bfloat16 | float16
    threads: int = 0  # torch intra-op threads; 0: one per core
    model_impl: str = "auto"  # auto (lean for Llama/Qwen2/Mistral, else hf) | hf | lean
    quantize: str = "auto"  # auto (a GGUF's own blocks, float weights as they are) | none | bf16 | int8 | int4
    speculate: str = "auto"  # auto (on where a measured verify makes drafts pay) | lookup | none
    kv_slots: int = 4  # conversations whose KV cache is kept between calls
    kv_memory_mb: int = 2048  # bound on all slots together
    parallel: int = 4  # generations decoded together, each step one forward over all their rows
    max_queue: int = 16  # requests waiting behind the running ones; beyond: 503
    max_body_bytes: int = 4 * 1024 * 1024
    max_messages: int = 1024
    max_tokens_default: int | None = None  # a chat-shaped reply's cap where the request gives none; None: the context
    temperature_default: float | None = None  # the temperature where a request gives none; None: 1.0 (OpenAI's, Anthropic's)
    reasoning: str = "on"  # on | off: a thinking template's <think> by default (a request may say otherwise)
    reasoning_budget: int | None = None  # thinking tokens allowed before the decode loop closes the thinking; None: no cap
    responses_store: int = 256  # /v1/responses kept in memory for previous_response_id (oldest dropped first); 0: none
    api_key: str | None = None  # Bearer token clients must send
    api_auth: str | None = None  # "user:password" for HTTP Basic
    cors_origin: str | None = None  # e.g. "*" or "http://localhost:3000"; None: CORS off
    web_ui: bool = True  # the chat page at GET /
    log_level: str = "info"
    log_format: str = "text"  # text | json (one JSON object per line)


# Settings with a fixed set of values: the flags offer these, and a config file is held to them.
CHOICES = {
    "device": ("auto", "cpu", "cuda"),
    "dtype": ("float32", "bfloat16", "float16"),
    "model_impl": ("auto", "hf", "lean"),
    "quantize": ("auto", "none", "bf16", "int8", "int4"),
    "speculate": ("auto", "lookup", "none"),
    "reasoning": ("on", "off"),
    "log_level": ("debug", "info", "warning", "error"),
    "log_format": ("text", "json"),
}


def load_yaml(path: str) -> dict:
    """Settings from a YAML file; unknown keys are an error, so typos do not pass silently."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of setting: value")
    known = {f.name for f in dataclasses.fields(Config)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{path}: unknown settings {', '.join(unknown)}")
    return {key.replace("-", "_"): value for key, value in data.items()}


def build(file: str | None, overrides: dict) -> Config:
    values = load_yaml(file) if file else {}
    values.update({key: value for key, value in overrides.items() if value is not None})
    if isinstance(values.get("reasoning"), bool):  # YAML 1.1 reads a bare on / off as a boolean
        values["reasoning"] = "on" if values["reasoning"] else "off"
    for key, allowed in CHOICES.items():
        if key in values and values[key] not in allowed:
            raise ValueError(f"{key} is {values[key]!r}; expected one of {', '.join(allowed)}")
    for f in dataclasses.fields(Config):
        if f.type is bool and f.name in values and not isinstance(values[f.name], bool):
            raise ValueError(f"{f.name} is {values[f.name]!r}; expected true or false")
    if values.get("max_tokens_default") is not None and not (isinstance(values["max_tokens_default"], int) and values["max_tokens_default"] >= 1):
        raise ValueError(f"max_tokens_default is {values['max_tokens_default']!r}; expected a whole number of tokens, at least 1")
    temperature = values.get("temperature_default")
    if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature <= 2):
        raise ValueError(f"temperature_default is {temperature!r}; expected a number from 0 to 2")
    parallel = values.get("parallel")
    if parallel is not None and (isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1):
        raise ValueError(f"parallel is {parallel!r}; expected a whole number of generations, at least 1")
    budget = values.get("reasoning_budget")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
        raise ValueError(f"reasoning_budget is {budget!r}; expected a whole number of tokens, 0 or more")
    return Config(**values)
