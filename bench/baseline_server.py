"""Benchmark baseline: what the reference implementation does, as a minimal OpenAI-style server.

Each request renders the chat template and calls transformers ``generate``
from scratch (no KV cache kept between requests), streaming through a
``TextIteratorStreamer`` fed by the generating thread. Only what the
benchmark sends is supported: messages, max_tokens, temperature, top_p,
stream and stream_options.include_usage. Not product code.

    python -m bench.baseline_server --port 8001 --threads 2
"""
import argparse
import asyncio
import threading
import time
import uuid

import orjson
import torch
import tornado.ioloop
import tornado.web
from transformers import AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer

from tornchat import checkpoint

MODEL_ID = "baseline"


class State:
    def __init__(self, directory: str):
        self.tokenizer = AutoTokenizer.from_pretrained(directory)
        self.model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        self.lock = asyncio.Lock()  # one generation at a time, as in the reference


def chunk(rid: str, delta: dict, finish: str | None = None, usage: dict | None = None) -> bytes:
    body = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": MODEL_ID,
            "choices": [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage:
        body["usage"] = usage
    return b"data: " + orjson.dumps(body) + b"\n\n"


class Completions(tornado.web.RequestHandler):
    def initialize(self, state: State):
        self.state = state

    async def post(self):
        body = orjson.loads(self.request.body)
        tok, model = self.state.tokenizer, self.state.model
        inputs = tok.apply_chat_template(body["messages"], add_generation_prompt=True, return_tensors="pt", return_dict=True)
        temperature = float(body.get("temperature", 1.0))
        kwargs = dict(**inputs, max_new_tokens=int(body.get("max_tokens") or 256), pad_token_id=tok.eos_token_id)
        if temperature < 0.01:
            kwargs.update(do_sample=False)
        else:
            kwargs.update(do_sample=True, temperature=temperature, top_p=float(body.get("top_p", 1.0)))
        streamer = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True)
        result = {}

        def run():
            result["ids"] = model.generate(**kwargs, streamer=streamer)

        rid = "chatcmpl-" + uuid.uuid4().hex
        async with self.state.lock:
            worker = threading.Thread(target=run, daemon=True)
            worker.start()
            loop = tornado.ioloop.IOLoop.current()
            stream = bool(body.get("stream"))
            if stream:
                self.set_header("Content-Type", "text/event-stream")
                self.write(chunk(rid, {"role": "assistant", "content": ""}))
                await self.flush()
            pieces = []
            while (piece := await loop.run_in_executor(None, next, streamer, None)) is not None:
                pieces.append(piece)
                if stream and piece:
                    self.write(chunk(rid, {"content": piece}))
                    await self.flush()
            await loop.run_in_executor(None, worker.join)
        prompt_len = inputs["input_ids"].shape[1]
        new_ids = result["ids"][0, prompt_len:].tolist()
        finish = "length" if len(new_ids) >= kwargs["max_new_tokens"] and new_ids[-1] != tok.eos_token_id else "stop"
        usage = {"prompt_tokens": prompt_len, "completion_tokens": len(new_ids), "total_tokens": prompt_len + len(new_ids)}
        if not stream:
            self.set_header("Content-Type", "application/json")
            self.write(orjson.dumps({
                "id": rid, "object": "chat.completion", "created": int(time.time()), "model": MODEL_ID,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(pieces)}, "finish_reason": finish}],
                "usage": usage,
            }))
            return
        self.write(chunk(rid, {}, finish))
        if (body.get("stream_options") or {}).get("include_usage"):
            self.write(chunk(rid, {}, usage=usage))
        self.write(b"data: [DONE]\n\n")


class Models(tornado.web.RequestHandler):
    def get(self):
        self.write({"object": "list", "data": [{"id": MODEL_ID, "object": "model", "owned_by": "bench"}]})


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--checkpoint-path", help="HF directory (default: the converted embedded SmolLM2)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    state = State(str(checkpoint.resolve(args.checkpoint_path)))
    app = tornado.web.Application([
        (r"/v1/chat/completions", Completions, {"state": state}),
        (r"/v1/models", Models),
        (r"/health", Models),
    ])
    app.listen(args.port, address="127.0.0.1")
    print(f"baseline listening on 127.0.0.1:{args.port}", flush=True)
    tornado.ioloop.IOLoop.current().start()


if __name__ == "__main__":
    main()
