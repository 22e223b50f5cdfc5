"""A GGUF's tokenizer built straight from its metadata with the tokenizers library.

transformers' GGUF conversion (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``) reads the whole
file through the gguf package and a model config first, most of a first start (docs/performance.md).
This builds the same tokenizer from the arrays ``gguf_file.GGUFFile.array`` reads in
milliseconds: the same BPE model, pre-tokenizer, decoder, post-processor and added tokens, so its
ids, its decoding and its special tokens are transformers' (tests/test_gguf_tokenizer.py holds the
two equal, down to the serialized tokenizer). It is wrapped in ``GGUFTokenizer``, the part of a
transformers tokenizer's surface the server uses, not in transformers' own class: importing
transformers costs a first start 0.5-0.8 s. ``build`` answers None for a tokenizer it does not know;
the caller then uses transformers' conversion.

Covered: ``tokenizer.ggml.model`` "gpt2" (byte-level BPE: SmolLM2, Llama 3, Qwen2) with the
pre-tokenizers below, and "llama" (SentencePiece-style BPE with byte fallback: Llama 2, Mistral).
"""
import logging

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

log = logging.getLogger("tornchat.checkpoint")

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types

# Split patterns by ``tokenizer.ggml.pre`` (None: a file without one), as transformers' conversion
# (integrations/gguf/gguf_tokenizer_mapping.py) has them; a test holds them to its table. A pattern
# None is GPT-2's own, which that conversion keeps for every name it has no entry for. The names are
# those of files we have (SmolLM2's smollm) and the common families; any other name goes to transformers.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {None: None, "gpt2": None, "default": None, "smollm": None, "llama-bpe": _LLAMA3, "llama3": _LLAMA3,
          "llama-v3": _LLAMA3, "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of each byte, as byte-level vocabularies write their tokens."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    spelled, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in spelled:
            spelled[b] = chr(256 + extra)
            extra += 1
    return spelled


def build(file):
    """The tokenizer of a ``gguf_file.GGUFFile``, or None where its model or pre-tokenizer is one this does
    not build."""
    kind, pre = file.value("tokenizer.ggml.model"), file.value("tokenizer.ggml.pre")
    if not (kind == "gpt2" and pre in SPLITS or kind == "llama" and pre in (None, "default")):
        log.info("tokenizer %r with pre-tokenizer %r: built by transformers' GGUF conversion", kind, pre)
        return None
    tokens, types = file.array("tokenizer.ggml.tokens"), file.array("tokenizer.ggml.token_type")
    merges = file.array("tokenizer.ggml.merges")
    if kind == "gpt2":
        backend = _byte_level(tokens, merges, SPLITS[pre])
        alphabet = set(bytes_to_unicode().values())
        # A control token outside the byte alphabet is a llama.cpp mislabel; transformers skips it.
        _add_file_tokens(backend, tokens, types, lambda token: set(token) <= alphabet)
        return _wrap(file, tokens, backend, {})
    backend = _sentencepiece(tokens, merges, file.array("tokenizer.ggml.scores"))
    _add_file_tokens(backend, tokens, types, lambda token: True)
    # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise (older files lack the flag).
    return _wrap(file, tokens, backend, {"add_bos_token": True})


def _byte_level(tokens: list[str], merges: list[str], split: str | None) -> Tokenizer:
    """Byte-level BPE as transformers' GPT2Tokenizer builds it, tokens respelled into its byte alphabet where
    the file writes them otherwise."""
    spelling = bytes_to_unicode()
    outside = str.maketrans("", "", "".join(spelling.values()))  # what is left of a token is outside the alphabet
    vocab = {}
    for index, token in enumerate(tokens):  # translate in C: a set per token took 0.3 s for 262,144 tokens
        vocab[token if not token.translate(outside) else "".join(spelling[b] for b in token.encode("utf-8"))] = index
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(merge.split(" ")) for merge in merges], dropout=None,
                                   continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    # GPT2Tokenizer's own defaults (unk, bos and eos "<|endoftext|>") are special tokens before the file's:
    # a vocabulary without that token (Llama 3's) gets it as one more id, as transformers gives it.
    backend.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
    return backend


def _sentencepiece(tokens: list[str], merges: list[str] | None, scores) -> Tokenizer:
    """SentencePiece-style BPE with byte fallback as transformers' LlamaTokenizer builds it; a file without
    merges (most) gets them derived from its scores, as transformers derives them."""
    vocab = {token: index for index, token in enumerate(tokens)}
    if merges is not None:
        pairs = [tuple(merge.split(" ")) for merge in merges]
    else:
        pairs = _merges_from_scores(vocab, dict(zip(tokens, scores.tolist())))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True, dropout=None))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(content=" ", left=1)])
    # LlamaTokenizer's own defaults, special before the file's tokens.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    return backend


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Each split of a token into two tokens as a merge, the highest-scoring token's first, then the longer
    left and the longer right piece, a token's own splits by their pieces' ids: the order in which
    transformers' generate_merges ranks them (a stable sort, so ties keep that order)."""
    ranked = []
    for token, score in scores.items():
        splits = [(token[:cut], token[cut:]) for cut in range(1, len(token)) if token[:cut] in vocab and token[cut:] in vocab]
        splits.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        ranked.extend((score, len(left), len(right), (left, right)) for left, right in splits)
    ranked.sort(key=lambda merge: merge[:3], reverse=True)
    return [merge[3] for merge in ranked]


def _add_file_tokens(backend: Tokenizer, tokens: list[str], types, controllable) -> None:
    """Control tokens (``<|im_start|>``) as special tokens and user-defined ones (``<think>``) as plain added
    tokens, both matched whole in the text, as transformers' conversion adds them."""
    if types is None:
        return
    control = [AddedToken(tokens[i], normalized=False, special=True)
               for i in (types == CONTROL).nonzero()[0] if controllable(tokens[i])]
    if control:
        backend.add_special_tokens(control)
    # token_to_id looks in the model's vocabulary and the added tokens, as get_vocab(with_added_tokens=True)
    # would, without building that dict of the whole vocabulary
    user = [AddedToken(tokens[i], normalized=False, special=False)
            for i in (types == USER_DEFINED).nonzero()[0] if backend.token_to_id(tokens[i]) is not None]
    if user:
        backend.add_tokens(user)


# transformers' named special tokens, in the order its all_special_tokens lists them
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class GGUFTokenizer:
    """A tokenizers backend with the settings a GGUF gives it, answering as transformers' fast tokenizer
    does for the calls the server makes (encode, decode, special tokens and their ids, the token-id
    conversions); its chat template renders in ``prompt.render``."""

    def __init__(self, backend: Tokenizer, special: dict[str, str | None], chat_template: str | None = None,
                 add_bos_token: bool = False, add_eos_token: bool = False):
        self.backend_tokenizer = backend
        self.special_tokens_map = {name: special[name] for name in SPECIAL_NAMES if special.get(name) is not None}
        self.chat_template = chat_template
        # transformers drops a flag whose token the file does not name
        self.add_bos_token = add_bos_token and self.bos_token is not None
        self.add_eos_token = add_eos_token and self.eos_token is not None
        # as transformers' TokenizersBackend.update_post_processor sets it: the flags decide what encode adds
        bos = [self.bos_token] if self.add_bos_token else []
        eos = [self.eos_token] if self.add_eos_token else []
        backend.post_processor = processors.TemplateProcessing(
            single=" ".join(bos + ["$A"] + eos),
            pair=" ".join(bos + ["$A"] + eos + [f"{token}:1" for token in bos] + ["$B:1"] + [f"{token}:1" for token in eos]),
            special_tokens=[(token, backend.token_to_id(token)) for token in bos + eos])

    def __getattr__(self, name: str):
        """bos_token, eos_token, unk_token, pad_token (None where the file names none) and their ids."""
        token_name = name.removesuffix("_id")
        if token_name not in SPECIAL_NAMES:
            raise AttributeError(name)
        token = self.special_tokens_map.get(token_name)
        return token if token is None or token_name == name else self.convert_tokens_to_ids(token)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens=add_special_tokens)}

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary without the added tokens."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    @property
    def added_tokens_decoder(self) -> dict:
        return self.backend_tokenizer.get_added_tokens_decoder()

    @property
    def all_special_ids(self) -> list[int]:
        return self.convert_tokens_to_ids(list(dict.fromkeys(self.special_tokens_map.values())))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        # transformers would clean up tokenization spaces where told to, but never for BPE, which these all are
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | list[int] | None:
        """A token's id, the unknown token's (None where there is none) for a text not in the vocabulary."""
        if not isinstance(tokens, str):
            return [self.convert_tokens_to_ids(token) for token in tokens]
        token_id = self.backend_tokenizer.token_to_id(tokens)
        return token_id if token_id is not None else self.unk_token_id

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self.backend_tokenizer.id_to_token(i) for i in ids]


def _wrap(file, tokens: list[str], backend: Tokenizer, settings: dict) -> GGUFTokenizer:
    """``backend`` with the settings transformers' conversion gives it: special tokens named by the file's ids,
    the chat template, BOS (or EOS) added where the file says so."""
    for name, key in (("add_bos_token", "tokenizer.ggml.add_bos_token"), ("add_eos_token", "tokenizer.ggml.add_eos_token"),
                      ("chat_template", "tokenizer.chat_template")):
        if file.value(key) is not None:
            settings[name] = file.value(key)
    special = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                      ("pad_token", "padding_token_id")):
        token_id = file.value(f"tokenizer.ggml.{key}")
        special[name] = tokens[token_id] if token_id is not None else None
    return GGUFTokenizer(backend, special, **settings)
