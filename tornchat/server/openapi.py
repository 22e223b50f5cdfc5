"""The OpenAPI 3.1 document served at GET /openapi.json.

Written by hand to say what validate.py accepts and replies.py sends (the
logits processors' fields are generated from their records); the
reliability tests check live replies against these schemas and fuzz the
server with bodies generated from the request schema, so a drift between
this file and the code fails there.
"""
from tornchat import MODEL_ID, __version__
from tornchat.config import Config
from tornchat.engine import processors
from tornchat.server import auth
from tornchat.server.validate import COMPLETION_MAX_TOKENS, EFFORTS, MAX_CHOICES, MAX_STOP, MAX_TOP_LOGPROBS, ROLES


def _optional(schema: dict) -> dict:
    """A request field that may also be null, which means "not given"."""
    return {"anyOf": [schema, {"type": "null"}]}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _option(option: processors.Field) -> dict:
    """A logits processor's request field, as its record declares it (validate._option checks the same)."""
    if option.kind == processors.STRINGS:
        schema = {"type": "array", "maxItems": option.high, "items": {"type": "string", "minLength": 1, "maxLength": option.longest}}
    elif option.kind == processors.BIAS:
        schema = {"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
                  "additionalProperties": {"type": "number", "minimum": option.low, "maximum": option.high}}
    else:
        schema = {"type": option.kind, "exclusiveMinimum" if option.above_low else "minimum": option.low, "maximum": option.high}
    schema = {key: value for key, value in schema.items() if value is not None}
    # default: the neutral value, which leaves the logits as they are (the tuples validation builds, as JSON)
    neutral = dict(option.neutral) if option.kind == processors.BIAS else option.neutral
    return _optional({**schema, "default": list(neutral) if isinstance(neutral, tuple) else neutral, "description": option.doc})


# Request fields of the logits processors, from their records.
PROCESSOR_FIELDS = {option.name: _option(option) for processor in processors.PROCESSORS for option in processor.fields}
ERROR = _ref("Error")
CALL = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string"}, "arguments": {"type": "string", "description": "JSON-encoded arguments"}},
}
TOOL_CALL = {
    "type": "object",
    "required": ["id", "function"],
    "properties": {"id": {"type": "string"}, "type": {"const": "function"}, "function": CALL},
}
USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens": {"type": "integer", "minimum": 0},
        "completion_tokens": {"type": "integer", "minimum": 0},
        "total_tokens": {"type": "integer", "minimum": 0},
        "prompt_tokens_details": {
            "type": "object",
            "properties": {"cached_tokens": {"type": "integer", "minimum": 0, "description": "Taken from a KV-cache slot"}},
        },
        "completion_tokens_details": {
            "type": "object",
            "properties": {
                "reasoning_tokens": {"type": "integer", "minimum": 0},
                "accepted_prediction_tokens": {"type": "integer", "minimum": 0,
                                               "description": "Drafted tokens (speculation) the sampler kept"},
                "rejected_prediction_tokens": {"type": "integer", "minimum": 0,
                                               "description": "Drafted tokens it did not keep"},
            },
        },
    },
}
FINISH_REASON = {"enum": ["stop", "length", "function_call", "tool_calls"]}
TOKEN = {
    "type": "object",
    "required": ["token", "logprob", "bytes"],
    "properties": {
        "token": {"type": "string"},
        "logprob": {"type": "number", "maximum": 0, "description": "-9999.0 stands for -infinity"},
        "bytes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}},
    },
}
CHAT_LOGPROBS = {
    "type": "object",
    "required": ["content"],
    "description": "The model's own log-probabilities: log_softmax of the raw logits, before temperature, truncation, penalties and bias",
    "properties": {
        "content": {
            "type": "array",
            "items": {
                **TOKEN,
                "required": [*TOKEN["required"], "top_logprobs"],
                "properties": {**TOKEN["properties"], "top_logprobs": {"type": "array", "maxItems": MAX_TOP_LOGPROBS, "items": TOKEN}},
            },
        }
    },
}
LEGACY_LOGPROBS = {
    "type": ["object", "null"],
    "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
    "properties": {
        "tokens": {"type": "array", "items": {"type": "string"}},
        "token_logprobs": {"type": "array", "items": {"type": "number", "maximum": 0}},
        "top_logprobs": {"type": "array", "items": {"type": "object", "additionalProperties": {"type": "number", "maximum": 0}}},
        "text_offset": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    },
}
CHOICE_INDEX = {"type": "integer", "minimum": 0, "maximum": MAX_CHOICES - 1}
# Request fields both generating endpoints take.
SAMPLING = {
    "temperature": _optional({"type": "number", "minimum": 0, "maximum": 2, "description": "Below 0.01: greedy"}),
    "top_p": _optional({"type": "number", "minimum": 0, "maximum": 1}),
    "top_k": _optional({"type": "integer", "minimum": 1}),
    **PROCESSOR_FIELDS,
    "seed": _optional({"type": "integer"}),
    "stream": _optional({"type": "boolean"}),
    "prediction": _optional({
        "type": "object", "required": ["type", "content"],
        "properties": {"type": {"const": "content"},
                       "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]}},
        "description": "Predicted Outputs: text the reply is expected to repeat; drafts come from it where speculation is on",
    }),
    "stream_options": _optional({"type": "object", "properties": {"include_usage": _optional({"type": "boolean"})}}),
    "stop": _optional({"anyOf": [{"type": "string"}, {"type": "array", "maxItems": MAX_STOP, "items": {"type": "string"}}]}),
    "n": _optional({"type": "integer", "minimum": 1, "maximum": MAX_CHOICES,
                    "description": "Choices, each its own generation; with a seed, choice i samples with seed + i"}),
}


def schemas(config: Config) -> dict:
    return {
        "Error": {
            "type": "object",
            "required": ["detail"],
            "properties": {"detail": {"type": "string", "description": "400s start with 'Invalid request: '"}},
        },
        "Message": {
            "type": "object",
            "required": ["role"],
            "properties": {
                "role": {"enum": list(ROLES)},
                "content": {
                    "description": "Text, or an array of text parts; null only on assistant messages",
                    "anyOf": [
                        {"type": "string"},
                        {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["type", "text"],
                                "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                            },
                        },
                        {"type": "null"},
                    ],
                },
                "name": _optional({"type": "string"}),
                "function_call": _optional({**CALL, "description": "Assistant messages only"}),
                "tool_calls": _optional({"type": "array", "minItems": 1, "items": TOOL_CALL, "description": "Assistant messages only"}),
                "tool_call_id": {"type": "string", "description": "Required on tool messages"},
            },
        },
        "FunctionDefinition": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                "description": _optional({"type": "string"}),
                "parameters": _optional({"type": "object", "description": "JSON Schema of the arguments; a call's arguments are held to it (400 if it cannot be enforced)"}),
            },
        },
        "ChatCompletionRequest": {
            "type": "object",
            "required": ["model", "messages"],
            "description": f"At most {config.max_body_bytes} bytes (413 beyond). Unknown fields are ignored.",
            "properties": {
                "model": {"type": "string", "description": f"Accepted, ignored: replies always report {MODEL_ID}"},
                "messages": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": config.max_messages,
                    "items": _ref("Message"),
                    "description": "At least one user message. The rendered prompt must leave room for one new token within max_length and the model's context",
                },
                **SAMPLING,
                "max_tokens": _optional({"type": "integer", "minimum": 1, "description": "New tokens"}),
                "max_completion_tokens": _optional({"type": "integer", "minimum": 1, "description": "Same as max_tokens; the smaller wins"}),
                "max_length": _optional({"type": "integer", "minimum": 1, "description": "Prompt plus new tokens"}),
                "reasoning_effort": _optional({"enum": list(EFFORTS), "description": "none: a thinking model does not think; any other: it does"}),
                "reasoning_budget": _optional({"type": "integer", "minimum": 0, "description": "Most thinking tokens; past them the server closes the thinking"}),
                "chat_template_kwargs": _optional({"type": "object", "description": "Variables for the chat template; enable_thinking: false turns thinking off"}),
                "logprobs": _optional({"type": "boolean", "description": "Each generated token's log-probability in choices[].logprobs"}),
                "top_logprobs": _optional(
                    {"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS, "description": "The most likely tokens at each position; needs logprobs: true"}
                ),
                "functions": _optional({"type": "array", "items": _ref("FunctionDefinition")}),
                "function_call": _optional(
                    {
                        "anyOf": [
                            {"enum": ["auto", "none"]},
                            {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}},
                        ]
                    }
                ),
                "tools": _optional(
                    {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["function"],
                            "properties": {"type": {"const": "function"}, "function": _ref("FunctionDefinition")},
                        },
                        "description": "Give either functions or tools",
                    }
                ),
                "tool_choice": _optional(
                    {
                        "anyOf": [
                            {"enum": ["auto", "none", "required"]},
                            {
                                "type": "object",
                                "required": ["function"],
                                "properties": {
                                    "type": {"const": "function"},
                                    "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}},
                                },
                            },
                        ]
                    }
                ),
                "response_format": _optional(
                    {
                        "description": "JSON replies held to a grammar: json_object gives one JSON object, json_schema JSON valid against the schema (also shown to the model)",
                        "anyOf": [
                            {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
                            {
                                "type": "object",
                                "required": ["type", "json_schema"],
                                "properties": {
                                    "type": {"const": "json_schema"},
                                    "json_schema": {
                                        "type": "object",
                                        "required": ["name", "schema"],
                                        "properties": {
                                            "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                                            "description": _optional({"type": "string"}),
                                            "schema": {"type": "object", "description": "JSON Schema of the reply (400 if it cannot be enforced)"},
                                            "strict": _optional({"type": "boolean", "description": "Accepted; the schema is always enforced"}),
                                        },
                                    },
                                },
                            },
                        ],
                    }
                ),
            },
        },
        "ChatCompletion": {
            "type": "object",
            "required": ["id", "object", "created", "model", "choices", "usage"],
            "properties": {
                "id": {"type": "string", "pattern": "^chatcmpl-"},
                "object": {"const": "chat.completion"},
                "created": {"type": "integer"},
                "model": {"const": MODEL_ID},
                "choices": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": MAX_CHOICES,
                    "items": {
                        "type": "object",
                        "required": ["index", "message", "finish_reason"],
                        "properties": {
                            "index": CHOICE_INDEX,
                            "message": {
                                "type": "object",
                                "required": ["role", "content"],
                                "properties": {
                                    "role": {"const": "assistant"},
                                    "content": {"type": ["string", "null"]},
                                    "function_call": CALL,
                                    "tool_calls": {"type": "array", "items": TOOL_CALL},
                                },
                            },
                            "finish_reason": FINISH_REASON,
                            "logprobs": CHAT_LOGPROBS,
                        },
                    },
                },
                "usage": USAGE,
            },
        },
        "ChatCompletionChunk": {
            "type": "object",
            "description": "One SSE record `data: {chunk}`; the stream ends with `data: [DONE]`. "
            "An error after the stream started is one record `data: {\"error\": {\"message\", \"type\"}}` before [DONE]",
            "required": ["id", "object", "created", "model", "choices"],
            "properties": {
                "id": {"type": "string", "pattern": "^chatcmpl-"},
                "object": {"const": "chat.completion.chunk"},
                "created": {"type": "integer"},
                "model": {"const": MODEL_ID},
                "choices": {
                    "type": "array",
                    "maxItems": 1,
                    "description": "One choice (by its index) per chunk; empty only in the usage chunk (stream_options.include_usage)",
                    "items": {
                        "type": "object",
                        "required": ["index", "delta", "finish_reason"],
                        "properties": {
                            "index": CHOICE_INDEX,
                            "delta": {
                                "type": "object",
                                "properties": {
                                    "role": {"const": "assistant"},
                                    "content": {"type": "string"},
                                    "function_call": {"type": "object"},
                                    "tool_calls": {"type": "array"},
                                },
                            },
                            "finish_reason": {"anyOf": [FINISH_REASON, {"type": "null"}]},
                            "logprobs": {**CHAT_LOGPROBS, "description": "The tokens that arrived since the previous chunk"},
                        },
                    },
                },
                "usage": USAGE,
            },
        },
        "CompletionRequest": {
            "type": "object",
            "required": ["model", "prompt"],
            "description": f"At most {config.max_body_bytes} bytes (413 beyond). Unknown fields are ignored.",
            "properties": {
                "model": {"type": "string", "description": f"Accepted, ignored: replies always report {MODEL_ID}"},
                "prompt": {
                    "description": "Text, sent as it is (no chat template), or token ids; one prompt per request",
                    "anyOf": [
                        {"type": "string"},
                        {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string"}},
                        {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
                    ],
                },
                **SAMPLING,
                "max_tokens": _optional({"type": "integer", "minimum": 1, "description": f"New tokens; {COMPLETION_MAX_TOKENS} if not given"}),
                "logprobs": _optional(
                    {"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS, "description": "Log-probabilities, with this many most likely tokens at each position"}
                ),
                "echo": _optional({"const": False}),
                "suffix": _optional({"const": "", "description": "Not supported"}),
                "best_of": _optional({"const": 1}),
            },
        },
        "Completion": {
            "type": "object",
            "description": "The reply, or with stream true one SSE record per chunk (object text_completion too; "
            "then, with stream_options.include_usage, a chunk with empty choices and usage), then `data: [DONE]`",
            "required": ["id", "object", "created", "model", "choices"],
            "properties": {
                "id": {"type": "string", "pattern": "^cmpl-"},
                "object": {"const": "text_completion"},
                "created": {"type": "integer"},
                "model": {"const": MODEL_ID},
                "choices": {
                    "type": "array",
                    "maxItems": MAX_CHOICES,
                    "items": {
                        "type": "object",
                        "required": ["index", "text", "logprobs", "finish_reason"],
                        "properties": {
                            "index": CHOICE_INDEX,
                            "text": {"type": "string"},
                            "logprobs": {**LEGACY_LOGPROBS, "description": "text_offset: characters from the start of the generated text"},
                            "finish_reason": {"enum": ["stop", "length", None]},
                        },
                    },
                },
                "usage": USAGE,
            },
        },
        "Model": {
            "type": "object",
            "required": ["id", "object", "created", "owned_by"],
            "properties": {
                "id": {"const": MODEL_ID},
                "object": {"const": "model"},
                "created": {"type": "integer"},
                "owned_by": {"type": "string"},
                "root": {"type": "null"},
                "parent": {"type": "null"},
                "permission": {"type": "null"},
            },
        },
        "ModelList": {
            "type": "object",
            "required": ["object", "data"],
            "properties": {"object": {"const": "list"}, "data": {"type": "array", "minItems": 1, "maxItems": 1, "items": _ref("Model")}},
        },
        "Health": {
            "type": "object",
            "required": ["status", "model_loaded", "queue_depth"],
            "properties": {
                "status": {"const": "ok"},
                "model_loaded": {"type": "boolean"},
                "queue_depth": {"type": "integer", "minimum": 0},
                "engine": {"type": "object", "additionalProperties": {"type": "integer"}},
                "server": {"type": "object", "additionalProperties": {"type": "integer"}},
                "kv": {"type": "object", "properties": {"slots": {"type": "integer"}, "bytes": {"type": "integer"}}},
                "queue_wait_s": {"type": "object", "description": "requests admitted, and their seconds in the queue summed",
                                 "properties": {"count": {"type": "integer"}, "sum": {"type": "number"}}},
            },
        },
    }


TEXT_PART = {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["input_text", "output_text", "text", "refusal"]},
                                                                      "text": {"type": "string"}}}
RESPONSE_ITEM = {
    "type": "object",
    "description": "An input item: a message (type may be left out), function_call, function_call_output, or reasoning "
                   "(its reasoning_text content, else its summary, is the next assistant turn's thinking). Other fields (id, status) are ignored",
    "properties": {
        "type": {"enum": ["message", "function_call", "function_call_output", "reasoning"]},
        "role": {"enum": ["user", "assistant", "system", "developer"]},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": TEXT_PART}]},
        "call_id": {"type": "string"},
        "name": {"type": "string"},
        "arguments": {"type": "string", "description": "JSON-encoded arguments"},
        "output": {"anyOf": [{"type": "string"}, {"type": "array", "items": TEXT_PART}]},
    },
}
OUTPUT_ITEM = {
    "type": "object",
    "required": ["id", "type", "status"],
    "properties": {
        "id": {"type": "string"},
        "type": {"enum": ["message", "function_call"]},
        "status": {"enum": ["in_progress", "completed", "incomplete"]},
        "role": {"const": "assistant"},
        "content": {"type": "array", "items": {"type": "object", "required": ["type", "text"],
                                               "properties": {"type": {"const": "output_text"}, "text": {"type": "string"}}}},
        "call_id": {"type": "string"},
        "name": {"type": "string"},
        "arguments": {"type": "string"},
    },
}
RESPONSE_USAGE = {
    "type": "object",
    "required": ["input_tokens", "output_tokens", "total_tokens"],
    "properties": {
        "input_tokens": {"type": "integer", "minimum": 0},
        "input_tokens_details": {"type": "object", "properties": {"cached_tokens": {"type": "integer", "minimum": 0}}},
        "output_tokens": {"type": "integer", "minimum": 0},
        "total_tokens": {"type": "integer", "minimum": 0},
    },
}
ANTHROPIC_BLOCK = {
    "type": "object",
    "required": ["type"],
    "description": "text, tool_use (assistant messages), tool_result (user messages); an assistant's thinking blocks are the turn's earlier thinking",
    "properties": {
        "type": {"enum": ["text", "tool_use", "tool_result", "thinking", "redacted_thinking"]},
        "text": {"type": "string"},
        "id": {"type": "string"},
        "name": {"type": "string"},
        "input": {"type": "object"},
        "tool_use_id": {"type": "string"},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
    },
}
ANTHROPIC_USAGE = {
    "type": "object",
    "required": ["input_tokens", "output_tokens"],
    "properties": {
        "input_tokens": {"type": "integer", "minimum": 0, "description": "Prompt tokens prefilled (not read from a KV slot)"},
        "cache_read_input_tokens": {"type": "integer", "minimum": 0, "description": "Prompt tokens taken from a KV-cache slot"},
        "cache_creation_input_tokens": {"type": "integer", "minimum": 0},
        "output_tokens": {"type": "integer", "minimum": 0},
    },
}
# Sampling fields the agent APIs read the same way (validate._sampling); named apart from SAMPLING, which
# schemas() reads when it runs.
AGENT_SAMPLING = {
    "temperature": _optional({"type": "number", "minimum": 0, "maximum": 2}),
    "top_p": _optional({"type": "number", "minimum": 0, "maximum": 1}),
    "top_k": _optional({"type": "integer", "minimum": 1}),
    "seed": _optional({"type": "integer"}),
    **PROCESSOR_FIELDS,
}


def agent_schemas(config: Config) -> dict:
    """The Responses (OpenAI) and Messages (Anthropic) APIs' bodies, as far as tornchat reads and writes them."""
    return {
        "ResponseRequest": {
            "type": "object",
            "required": ["model", "input"],
            "description": "OpenAI's Responses API. Unlisted fields (include, prompt_cache_key, ...) are ignored; "
                           "tools of types other than function are ignored",
            "properties": {
                "model": {"type": "string"},
                "input": {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "maxItems": config.max_messages, "items": RESPONSE_ITEM}]},
                "instructions": _optional({"type": "string"}),
                "previous_response_id": _optional({"type": "string", "description": f"One of the last {config.responses_store} responses (responses_store)"}),
                "store": _optional({"type": "boolean"}),
                "tools": _optional({"type": "array", "items": {"type": "object", "properties": {
                    "type": {"type": "string"}, "name": {"type": "string"}, "description": {"type": "string"},
                    "parameters": {"type": "object"}}}}),
                "tool_choice": _optional({"anyOf": [{"enum": ["auto", "none", "required"]}, {
                    "type": "object", "required": ["type", "name"], "properties": {"type": {"const": "function"}, "name": {"type": "string"}}}]}),
                "parallel_tool_calls": _optional({"type": "boolean"}),
                "text": _optional({"type": "object", "properties": {"format": {"type": "object", "properties": {
                    "type": {"enum": ["text", "json_object", "json_schema"]}, "name": {"type": "string"}, "schema": {"type": "object"}}}}}),
                "max_output_tokens": _optional({"type": "integer", "minimum": 1}),
                "stream": _optional({"type": "boolean"}),
                "truncation": _optional({"const": "disabled"}),
                **AGENT_SAMPLING,
            },
        },
        "Response": {
            "type": "object",
            "required": ["id", "object", "created_at", "status", "model", "output"],
            "description": "The reply, and the response object of the stream's lifecycle events",
            "properties": {
                "id": {"type": "string"},
                "object": {"const": "response"},
                "created_at": {"type": "integer"},
                "status": {"enum": ["in_progress", "completed", "incomplete", "failed"]},
                "model": {"const": MODEL_ID},
                "output": {"type": "array", "items": OUTPUT_ITEM},
                "usage": _optional(RESPONSE_USAGE),
                "error": _optional({"type": "object", "properties": {"code": {"type": "string"}, "message": {"type": "string"}}}),
                "incomplete_details": _optional({"type": "object", "properties": {"reason": {"const": "max_output_tokens"}}}),
                "previous_response_id": _optional({"type": "string"}),
            },
        },
        "ResponseStreamEvent": {
            "type": "object",
            "required": ["type", "sequence_number"],
            "description": "Each SSE record's data; its event line names the type. In order: response.created, response.in_progress, "
                           "then per output item output_item.added, (content_part.added, output_text.delta..., output_text.done, "
                           "content_part.done | function_call_arguments.delta..., function_call_arguments.done), output_item.done; "
                           "last response.completed, response.incomplete (max_output_tokens) or response.failed",
            "properties": {
                "type": {"enum": ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
                                  "response.output_text.delta", "response.output_text.done", "response.content_part.done",
                                  "response.function_call_arguments.delta", "response.function_call_arguments.done",
                                  "response.output_item.done", "response.completed", "response.incomplete", "response.failed"]},
                "sequence_number": {"type": "integer", "minimum": 0},
                "response": _ref("Response"),
                "item": OUTPUT_ITEM,
                "output_index": {"type": "integer", "minimum": 0},
                "delta": {"type": "string"},
            },
        },
        "ResponsesError": {
            "type": "object",
            "required": ["error"],
            "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
                "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"], "description": "context_length_exceeded for a prompt longer than the context"}}}},
        },
        "MessagesRequest": {
            "type": "object",
            "required": ["model", "max_tokens", "messages"],
            "description": "Anthropic's Messages API. Ignored: metadata, context_management, output_config, "
                           "cache_control, betas, and tools of Anthropic's server types",
            "properties": {
                "model": {"type": "string"},
                "max_tokens": {"type": "integer", "minimum": 1},
                "system": _optional({"anyOf": [{"type": "string"}, {"type": "array", "items": {
                    "type": "object", "required": ["type", "text"], "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]}),
                "messages": {"type": "array", "minItems": 1, "maxItems": config.max_messages, "items": {
                    "type": "object", "required": ["role", "content"], "properties": {
                        "role": {"enum": ["user", "assistant", "system"]},
                        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": ANTHROPIC_BLOCK}]}}}},
                "tools": _optional({"type": "array", "items": {"type": "object", "required": ["name"], "properties": {
                    "name": {"type": "string"}, "description": {"type": "string"}, "input_schema": {"type": "object"}}}}),
                "tool_choice": _optional({"type": "object", "required": ["type"], "properties": {
                    "type": {"enum": ["auto", "any", "tool", "none"]}, "name": {"type": "string"},
                    "disable_parallel_tool_use": {"type": "boolean"}}}),
                "stop_sequences": _optional({"type": "array", "maxItems": MAX_STOP, "items": {"type": "string"}}),
                "stream": _optional({"type": "boolean"}),
                **AGENT_SAMPLING,
            },
        },
        "AnthropicMessage": {
            "type": "object",
            "required": ["id", "type", "role", "model", "content", "stop_reason", "usage"],
            "properties": {
                "id": {"type": "string"},
                "type": {"const": "message"},
                "role": {"const": "assistant"},
                "model": {"const": MODEL_ID},
                "content": {"type": "array", "items": {"type": "object", "required": ["type"], "properties": {
                    "type": {"enum": ["text", "tool_use"]}, "text": {"type": "string"}, "id": {"type": "string"},
                    "name": {"type": "string"}, "input": {"type": "object"}}}},
                "stop_reason": {"enum": ["end_turn", "max_tokens", "tool_use", None]},
                "stop_sequence": {"type": "null"},
                "usage": ANTHROPIC_USAGE,
            },
        },
        "MessageStreamEvent": {
            "type": "object",
            "required": ["type"],
            "description": "Each SSE record's data; its event line names the type. In order: message_start, ping, per block "
                           "content_block_start, content_block_delta (text_delta or input_json_delta)..., content_block_stop; "
                           "then message_delta (stop_reason, usage) and message_stop; or an error event",
            "properties": {
                "type": {"enum": ["message_start", "ping", "content_block_start", "content_block_delta", "content_block_stop",
                                  "message_delta", "message_stop", "error"]},
                "message": _ref("AnthropicMessage"),
                "index": {"type": "integer", "minimum": 0},
                "content_block": {"type": "object"},
                "delta": {"type": "object"},
                "usage": ANTHROPIC_USAGE,
            },
        },
        "CountTokensRequest": {
            "type": "object",
            "required": ["model", "messages"],
            "description": "A Messages request (max_tokens not needed)",
            "properties": {"model": {"type": "string"}, "messages": {"type": "array", "minItems": 1}, "system": {}, "tools": {}},
        },
        "TokenCount": {"type": "object", "required": ["input_tokens"], "properties": {"input_tokens": {"type": "integer", "minimum": 0}}},
        "AnthropicError": {
            "type": "object",
            "required": ["type", "error"],
            "properties": {
                "type": {"const": "error"},
                "error": {"type": "object", "required": ["type", "message"], "properties": {
                    "type": {"type": "string"},
                    "message": {"type": "string", "description": "A prompt longer than the context: 'prompt is too long: N tokens > M maximum ...'"}}},
            },
        },
    }


def _agent_paths() -> dict:
    unauthorized = "Missing or wrong credentials (only when --api-key or --api-auth is set)"

    def errors(schema: dict, key_header: str) -> dict:
        return {
            "400": _json(schema, "Invalid request: the message names the field, or the prompt is too long for the context"),
            "401": _json(schema, unauthorized + key_header),
            "413": _json(schema, "Body larger than max_body_bytes"),
            "500": _json(schema, "Internal server error (no details)"),
            "503": _json(schema, "Queue full, device out of memory, or server shutting down; with Retry-After"),
        }

    anthropic_errors = errors(_ref("AnthropicError"), "; x-api-key is accepted beside Authorization: Bearer")
    beta = [{"name": "beta", "in": "query", "required": False, "schema": {"type": "string"}, "description": "Accepted, ignored"}]
    return {
        "/v1/responses": {
            "post": {
                "summary": "OpenAI's Responses API (Codex CLI): the next output items, as one JSON body or a stream of named events",
                "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("ResponseRequest")}}},
                "responses": {
                    "200": {"description": "The response (stream false) or its events (stream true)", "content": {
                        "application/json": {"schema": _ref("Response")}, "text/event-stream": {"schema": _ref("ResponseStreamEvent")}}},
                    **errors(_ref("ResponsesError"), ""),
                },
            }
        },
        "/v1/messages": {
            "post": {
                "summary": "Anthropic's Messages API (Claude Code): the assistant's next message, as one JSON body or a stream of named events",
                "parameters": beta,
                "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("MessagesRequest")}}},
                "responses": {
                    "200": {"description": "The message (stream false) or its events (stream true)", "content": {
                        "application/json": {"schema": _ref("AnthropicMessage")}, "text/event-stream": {"schema": _ref("MessageStreamEvent")}}},
                    **anthropic_errors,
                },
            }
        },
        "/v1/messages/count_tokens": {
            "post": {
                "summary": "The prompt tokens /v1/messages would have for this request; nothing is generated",
                "parameters": beta,
                "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("CountTokensRequest")}}},
                "responses": {"200": _json(_ref("TokenCount"), "The count"), **anthropic_errors},
            }
        },
    }


def _page(summary: str, content_type: str, parameters: list | None = None) -> dict:
    """A file of the chat page: open, like /health, and absent with --no-web-ui."""
    get = {"summary": summary, "security": [{}], "responses": {"200": {"description": summary, "content": {content_type: {"schema": {"type": "string"}}}}}}
    if parameters:
        get["parameters"] = parameters
        get["responses"]["404"] = _json(ERROR, "No such file")
    return {"get": get}


def _web_paths() -> dict:
    name = {"name": "file", "in": "path", "required": True, "schema": {"type": "string"}}
    return {
        "/": _page("The chat page (HTML). Never needs credentials; the API calls it makes carry the key the user types", "text/html"),
        "/web/{file}": _page("The chat page's script, style sheet and icon", "text/javascript", [name]),
    }


def _paths(config: Config) -> dict:
    errors = {
        "401": _json(ERROR, "Missing or wrong credentials (only when --api-key or --api-auth is set); with WWW-Authenticate"),
        "405": _json(ERROR, "Method not allowed"),
    }
    generation_errors = {
        "400": _json(ERROR, "Invalid request: the detail names the field, or the prompt is too long for the context"),
        "413": _json(ERROR, "Body larger than max_body_bytes"),
        "500": _json(ERROR, "Internal server error (no details)"),
        "503": _json(ERROR, "Queue full, device out of memory, or server shutting down; with Retry-After"),
        **errors,
    }
    return {
        "/health": {
            "get": {
                "summary": "Liveness: model loaded, queue depth, counters. Never needs credentials",
                "security": [{}],
                "responses": {"200": _json(_ref("Health"), "Server state")},
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics (text exposition; OpenMetrics on request)",
                "responses": {
                    "200": {"description": "Metrics", "content": {"text/plain": {"schema": {"type": "string"}}}},
                    **errors,
                },
            }
        },
        "/openapi.json": {
            "get": {
                "summary": "This document. Never needs credentials",
                "security": [{}],
                "responses": {"200": _json({"type": "object"}, "OpenAPI 3.1 document")},
            }
        },
        "/v1/models": {
            "get": {"summary": "The one model", "responses": {"200": _json(_ref("ModelList"), "Model list"), **errors}}
        },
        "/v1/models/{model}": {
            "get": {
                "summary": "One model by id",
                "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": _json(_ref("Model"), "The model"), "404": _json(ERROR, "Unknown model id"), **errors},
            }
        },
        "/v1/completions": {
            "post": {
                "summary": "Legacy text completion: continue the prompt as it is, as one JSON body or an SSE stream",
                "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("CompletionRequest")}}},
                "responses": {
                    "200": {
                        "description": "The completion (stream false) or a stream of chunks (stream true)",
                        "content": {"application/json": {"schema": _ref("Completion")}, "text/event-stream": {"schema": _ref("Completion")}},
                    },
                    **generation_errors,
                },
            }
        },
        "/v1/chat/completions": {
            "post": {
                "summary": "Generate the assistant's next message, as one JSON body or an SSE stream",
                "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("ChatCompletionRequest")}}},
                "responses": {
                    "200": {
                        "description": "The completion (stream false) or a stream of chunks (stream true)",
                        "content": {
                            "application/json": {"schema": _ref("ChatCompletion")},
                            "text/event-stream": {"schema": _ref("ChatCompletionChunk")},
                        },
                    },
                    **generation_errors,
                },
            }
        },
        **_agent_paths(),
        **(_web_paths() if config.web_ui else {}),
    }


def document(config: Config) -> dict:
    """The document for this server's limits and credentials."""
    schemes = {}
    if config.api_key:
        schemes["bearerAuth"] = {"type": "http", "scheme": "bearer"}
    if config.api_auth:
        schemes["basicAuth"] = {"type": "http", "scheme": "basic"}
    return {
        "openapi": "3.1.0",
        "info": {"title": "tornchat", "version": __version__, "description": "OpenAI-compatible chat completions, with the OpenAI Responses and Anthropic Messages APIs"},
        "paths": _paths(config),
        "components": {"schemas": {**schemas(config), **agent_schemas(config)}, "securitySchemes": schemes},
        "security": [{name: []} for name in schemes] if auth.required(config) else [{}],
    }
