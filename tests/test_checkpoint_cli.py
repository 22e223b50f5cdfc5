"""Checkpoint resolution, start-up errors, config precedence and prompt rendering."""
import json
import os
import subprocess
import sys
import time

import openai

from bench import servers
from tornchat import checkpoint, config, prompt


def start_error(tmp_path, *args) -> subprocess.CompletedProcess:
    env = dict(os.environ, TORNCHAT_CACHE=str(tmp_path / "cache"))
    return subprocess.run(
        [sys.executable, "-m", "tornchat", "serve", *args], capture_output=True, text=True, timeout=120, env=env
    )


def assert_one_line_error(result, *fragments):
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr
    assert lines and lines[-1].startswith("tornchat: ")
    for fragment in fragments:
        assert fragment in lines[-1]


def test_missing_path_is_a_one_line_error(tmp_path):
    assert_one_line_error(start_error(tmp_path, "--checkpoint-path", str(tmp_path / "nope")), "does not exist")


def test_corrupt_gguf_is_a_one_line_error(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(256))
    assert_one_line_error(start_error(tmp_path, "--checkpoint-path", str(bad)), "cannot read GGUF")


def test_unsupported_architecture_is_a_one_line_error(tmp_path):
    model_dir = tmp_path / "vit"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "vit", "architectures": ["ViTModel"]}))
    assert_one_line_error(start_error(tmp_path, "--checkpoint-path", str(model_dir)), "unsupported architecture")


def test_an_instruction_set_the_cpu_lacks_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TORNCHAT_ISA", "avx9000")
    assert_one_line_error(start_error(tmp_path), "TORNCHAT_ISA='avx9000'", "avx2")


def test_bad_config_file_is_a_one_line_error(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("prot: 8000\n")
    assert_one_line_error(start_error(tmp_path, "--config", str(cfg)), "unknown settings prot")


def test_bad_setting_value_in_config_file_is_a_one_line_error(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("quantize: fp8\n")
    assert_one_line_error(start_error(tmp_path, "--config", str(cfg)), "quantize is 'fp8'", "bf16")


def test_flags_override_config_file_which_overrides_defaults(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("port: 9001\nkv_slots: 2\n")
    settings = config.build(str(cfg), {"port": 9002, "kv_slots": None})
    assert (settings.port, settings.kv_slots, settings.host) == (9002, 2, "127.0.0.1")


def test_shipped_default_config_loads():
    here = os.path.dirname(__file__)
    settings = config.build(os.path.join(here, "..", "configs", "default.yaml"), {})
    assert settings == config.Config(**{**config.Config().__dict__, **config.load_yaml(os.path.join(here, "..", "configs", "default.yaml"))})


def test_gguf_conversion_is_cached(smol_dir):
    gguf = checkpoint.default_gguf_path()
    assert checkpoint.resolve(str(gguf)) == checkpoint.converted_dir(gguf)
    assert str(checkpoint.resolve(None)) == smol_dir


def test_rendered_prompt_has_exactly_one_bos(tokenizer):
    ids = prompt.encode(tokenizer, prompt.render(tokenizer, [{"role": "user", "content": "hi"}]))
    assert ids.count(tokenizer.bos_token_id) == ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>"))
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[1] != ids[0]


def test_fallback_template_for_checkpoints_without_one(tokenizer):
    original = tokenizer.chat_template
    tokenizer.chat_template = None
    try:
        text = prompt.render(tokenizer, [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    finally:
        tokenizer.chat_template = original
    assert text == "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n"


def test_end_of_turn_tokens_stop_generation(tokenizer):
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in prompt.stop_token_ids(tokenizer)


def test_a_first_start_measures_speculation_once_and_a_later_start_recalls_it(tmp_path):
    """Nothing cached: the server serves the file's own blocks at once and measures what a verify costs on
    this machine while it is idle (a request is served meanwhile); the next start reads that back instead of
    measuring again."""
    env = {"TORNCHAT_CACHE": str(tmp_path / "cache")}
    with servers.running(env=env) as server:
        client = openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0)
        ask = [{"role": "user", "content": "Name a colour."}]
        first = client.chat.completions.create(model="m", messages=ask, max_tokens=5, temperature=0)
        assert first.usage.completion_tokens >= 1
        assert "Q4_1" in server.log() and "speculation off until a verify's costs are measured" in server.log()
        deadline = time.monotonic() + 60
        while "measured while idle" not in server.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "one-token steps (measured while idle)" in server.log()
    assert (tmp_path / "cache" / "measurements.json").exists()
    with servers.running(env=env) as server:
        again = client_for(server).chat.completions.create(model="m", messages=ask, max_tokens=5, temperature=0)
        assert again.choices[0].message.content == first.choices[0].message.content
        assert "recalled" in server.log()


def client_for(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0)
