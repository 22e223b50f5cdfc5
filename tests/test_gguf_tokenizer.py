"""The GGUF tokenizer we build from a file's metadata against transformers' GGUF conversion of the same
file: the same serialized tokenizer, ids, decoding, special tokens and rendered chats; the conversion
where we do not build one; and no transformers imported where we do."""
import json
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from tornchat import checkpoint, prompt
from tornchat.weights import gguf_file, gguf_tokenizer

import gguf_files

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b  # sum\n\n\nclass X:\n\tpass\n",
    "    leading spaces, trailing   \n\n\n  \t \r\n mixed   runs\u00a0of whitespace     ",
    "1 12 123 1234 12345 3.14159 1,000,000 0x1F 2026-11-25",
    "naïve café Ünïcödé — “quotes” ‘single’ 日本語のテキスト 한국어 עברית العربية",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷 and a lone \u200d joiner",
    "<|im_start|>user\nhi<|im_end|> inside <|im_end|><|im_start|> text <|endoftext|>",
    "<think>reasoning</think> <|begin_of_text|><|eot_id|> <s> </s> <unk>",
    "I'm sure they'll've DON'T it's WE'RE",
    "",
    " ",
]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2? 😀"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "  and\n\n3*3?"}]
# what the server reads of a tokenizer besides encode, decode and the token-id conversions
ATTRIBUTES = ["bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id", "unk_token_id",
              "pad_token_id", "add_bos_token", "add_eos_token", "vocab_size", "chat_template", "all_special_ids",
              "special_tokens_map", "added_tokens_decoder"]
# Llama 3's control tokens over the embedded model's first five, no <|endoftext|> left: a Llama-3-style file.
LLAMA3 = {"renamed": dict(enumerate(["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>",
                                     "<|end_header_id|>"])),
          "pre": "llama-bpe", "add_bos_token": True, "bos_token_id": 0, "eos_token_id": 2, "padding_token_id": None,
          "chat_template": "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
                           "\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"}
FILES = {
    "embedded": None,  # SmolLM2: gpt2 with pre-tokenizer smollm
    "llama3": LLAMA3,
    "qwen2": {"arch": "qwen2", "pre": "qwen2"},
    "gpt2": {"pre": "gpt2"},
    "sentencepiece": "sentencepiece",  # "llama": Llama 2 / Mistral style
}


@pytest.fixture(scope="module", params=list(FILES))
def gguf(request, tmp_path_factory):
    fields = FILES[request.param]
    if fields is None:
        return checkpoint.default_gguf_path()
    if fields == "sentencepiece":
        fields = gguf_files.sentencepiece_vocabulary()
    return gguf_files.write_tokenizer(tmp_path_factory.mktemp("tok") / f"{request.param}.gguf", **fields)


@pytest.fixture(scope="module")
def pair(gguf):
    """(ours, transformers')."""
    ours = gguf_tokenizer.build(gguf_file.GGUFFile(gguf))
    assert ours is not None
    return ours, AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def test_the_serialized_tokenizer_is_transformers(pair):
    ours, theirs = pair
    assert json.loads(ours.backend_tokenizer.to_str()) == json.loads(theirs.backend_tokenizer.to_str())
    assert len(ours) == len(theirs)
    for name in ATTRIBUTES:
        assert getattr(ours, name) == getattr(theirs, name), name


@pytest.mark.parametrize("special", [True, False])
def test_ids_and_decoding_are_transformers(pair, special):
    ours, theirs = pair
    chat = theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert prompt.render(ours, MESSAGES) == chat
    for text in TEXTS + [chat]:
        ids = theirs.encode(text, add_special_tokens=special)
        assert ours.encode(text, add_special_tokens=special) == ids, text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    for marker in ("<|im_start|>", "<|im_end|>", "<|eot_id|>", "<think>", "<s>", "not-a-token"):
        assert ours.convert_tokens_to_ids(marker) == theirs.convert_tokens_to_ids(marker)
    every = list(range(len(theirs)))
    assert ours.convert_ids_to_tokens(every) == theirs.convert_ids_to_tokens(every)
    assert ours(TEXTS[0], add_special_tokens=special)["input_ids"] == theirs(TEXTS[0], add_special_tokens=special)["input_ids"]


def test_user_defined_tokens_match_whole_as_transformers_adds_them(tmp_path):
    """Tokens a file types user-defined (Qwen3's <think> and </think>) are plain added tokens, matched whole in the
    text; one outside the byte alphabet (a space in it) is not added, as transformers' conversion skips it."""
    import numpy as np

    source = gguf_file.GGUFFile(checkpoint.default_gguf_path())
    tokens = list(source.array("tokenizer.ggml.tokens")) + ["<think>", "</think>", " spaced"]
    types = np.concatenate([source.array("tokenizer.ggml.token_type"), [gguf_tokenizer.USER_DEFINED] * 3]).astype(np.int32)
    path = gguf_files.write_tokenizer(tmp_path / "user.gguf", tokens=tokens, token_type=types)
    ours = gguf_tokenizer.build(gguf_file.GGUFFile(path))
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file="user.gguf")
    think = len(tokens) - 3
    assert ours.encode("<think>", add_special_tokens=False) == [think]
    for text in ("<think>reasoning</think> the answer", "a spaced word"):
        assert ours.encode(text) == theirs.encode(text)
    assert json.loads(ours.backend_tokenizer.to_str())["added_tokens"] == \
        json.loads(theirs.backend_tokenizer.to_str())["added_tokens"]


def test_the_split_patterns_are_transformers():
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    for name, pattern in gguf_tokenizer.SPLITS.items():
        assert GGUF_PRE_TOKENIZER_SPLITS.get(name) == pattern, name


@pytest.mark.parametrize("kind, pre", [("gpt2", "tekken"), ("gpt2", "no-such-pre-tokenizer"), ("t5", None)])
def test_a_kind_we_do_not_build_is_left_to_transformers(tmp_path, kind, pre):
    path = gguf_files.write_tokenizer(tmp_path / "m.gguf", model=kind, pre=pre)
    assert gguf_tokenizer.build(gguf_file.GGUFFile(path)) is None


def test_the_fallback_is_transformers_conversion_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("TORNCHAT_CACHE", str(tmp_path / "cache"))
    path = gguf_files.write_tokenizer(tmp_path / "m.gguf", pre="tekken")
    first = checkpoint.tokenizer_from_gguf(gguf_file.GGUFFile(path))
    theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert json.loads(first.backend_tokenizer.to_str()) == json.loads(theirs.backend_tokenizer.to_str())
    assert list((tmp_path / "cache").glob("*-tokenizer/tokenizer_config.json"))  # saved for later starts
    again = checkpoint.tokenizer_from_gguf(gguf_file.GGUFFile(path))
    assert [again.encode(text) for text in TEXTS] == [theirs.encode(text) for text in TEXTS]


def test_a_tokenizer_we_build_is_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("TORNCHAT_CACHE", str(tmp_path))
    checkpoint.tokenizer_from_gguf(gguf_file.GGUFFile(checkpoint.default_gguf_path()))
    assert not list(tmp_path.iterdir())


def test_the_gemma_benchmark_vocabulary_chats_in_gemma_turns(tmp_path):
    """bench/make_gguf.py's gemma3 presets: the embedded model's tokens padded to Gemma's vocabulary size, its
    turn markers single control tokens, <end_of_turn> the end of a reply, Gemma's template."""
    import gguf
    import numpy as np
    from bench.make_gguf import GEMMA_MARKERS, gemma_tokenizer_fields, tokenizer_fields

    vocab = 60_000
    fields = {key.removeprefix("tokenizer.ggml.").removeprefix("tokenizer."): value for key, value, _, _ in
              gemma_tokenizer_fields(tokenizer_fields(gguf.GGUFReader(checkpoint.default_gguf_path())), vocab)}
    fields["token_type"] = np.array(fields["token_type"], dtype=np.int32)
    tokenizer = gguf_tokenizer.build(gguf_file.GGUFFile(gguf_files.write_tokenizer(tmp_path / "g.gguf", **fields)))
    bos, start, end = (tokenizer.convert_tokens_to_ids(t) for t in GEMMA_MARKERS)
    assert len(tokenizer) == vocab and tokenizer.eos_token_id == end == bos + 2 and tokenizer.bos_token_id == bos
    ids = prompt.encode(tokenizer, prompt.render(tokenizer, [{"role": "user", "content": " Hi "}]))
    text = tokenizer.encode
    assert ids == [bos, start, *text("user\nHi", add_special_tokens=False), end, *text("\n", add_special_tokens=False),
                   start, *text("model\n", add_special_tokens=False)]
    assert tokenizer.decode([vocab - 1]) == f"<unused{vocab - bos - 4}>"


def test_the_qwen3_benchmark_vocabulary_is_padded_to_qwen3s_size_and_encodes_as_before(tmp_path):
    """bench/make_gguf.py's qwen3 presets: the embedded model's tokens, then <unusedN> up to Qwen3's 151,936 rows,
    so the embedding and the head have the real size; text and chats encode to the embedded model's ids."""
    import gguf
    import numpy as np
    from bench.make_gguf import PRESETS, QWEN3_VOCAB, padded_tokenizer_fields, tokenizer_fields

    assert PRESETS["qwen3-0.6b"].vocab == PRESETS["qwen3-4b"].vocab == QWEN3_VOCAB == 151_936
    vocab = 60_000
    embedded = tokenizer_fields(gguf.GGUFReader(checkpoint.default_gguf_path()))
    fields = {key.removeprefix("tokenizer.ggml.").removeprefix("tokenizer."): value for key, value, _, _ in
              padded_tokenizer_fields(embedded, vocab)}
    fields["token_type"] = np.array(fields["token_type"], dtype=np.int32)
    padded = gguf_tokenizer.build(gguf_file.GGUFFile(gguf_files.write_tokenizer(tmp_path / "q.gguf", **fields)))
    original = checkpoint.tokenizer_from_gguf(gguf_file.GGUFFile(checkpoint.default_gguf_path()))
    assert len(padded) == vocab and padded.eos_token_id == original.eos_token_id
    chat = [{"role": "user", "content": "Write <unused3> a haiku about rain."}]
    assert prompt.encode(padded, prompt.render(padded, chat)) == prompt.encode(original, prompt.render(original, chat))
    assert padded.decode([vocab - 1]) == f"<unused{vocab - len(original) - 1}>"


def test_the_built_tokenizer_holds_its_backend_uncopied():
    """transformers' wrapper would deep-copy a backend given it (a JSON round trip: a quarter of a second at 262,144
    tokens); ours holds the one built from the file, with the post-processor the file's flags ask for."""
    from tokenizers import Tokenizer, models

    backend = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "ab": 2, "</s>": 3, "<s>": 4}, merges=[("a", "b")]))
    tokenizer = gguf_tokenizer.GGUFTokenizer(backend, {"bos_token": "<s>", "eos_token": "</s>"}, add_eos_token=True)
    assert tokenizer.backend_tokenizer is backend and tokenizer.eos_token_id == 3 and tokenizer.bos_token_id == 4
    assert tokenizer.encode("abab", add_special_tokens=False) == [2, 2]
    assert tokenizer.encode("abab") == [2, 2, 3]
    assert tokenizer.unk_token is None and tokenizer.convert_tokens_to_ids("zz") is None
    with pytest.raises(AttributeError):
        tokenizer.no_such_attribute


def test_a_built_tokenizer_serves_without_importing_transformers():
    """Where ``gguf_tokenizer`` builds the tokenizer, loading it, rendering a chat, encoding it and reading the
    vocabulary's bytes (the stop check's and the grammars') import no transformers, whose import costs a first start
    0.5-0.8 s; only the conversion's fallback does."""
    code = ("import sys; from tornchat import checkpoint, prompt; from tornchat.weights import gguf_file; "
            "from tornchat.kernels import stopcheck; from tornchat.engine import grammar; "
            "tokenizer = checkpoint.tokenizer_from_gguf(gguf_file.GGUFFile(checkpoint.default_gguf_path())); "
            "ids = prompt.encode(tokenizer, prompt.render(tokenizer, [{'role': 'user', 'content': 'hi'}])); "
            "assert tokenizer.decode(ids).endswith('assistant\\n') and stopcheck.prompt_bytes(tokenizer); "
            "grammar.Compiler(tokenizer).compile('start: \"yes\" | \"no\"'); "
            "print(type(tokenizer).__name__, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["GGUFTokenizer", "False"]
