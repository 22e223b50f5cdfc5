"""Shared fixtures: a tiny random-weight Llama for fast tests, the real SmolLM2 for integration."""
import copy
import json

import openai
import pytest
import torch
from tokenizers import AddedToken

from bench import servers
from tornchat import checkpoint, prompt
from tornchat.engine.grammar import Compiler
from tornchat.engine.model import HFRunner
from tornchat.engine.slots import SlotPool
from tornchat.engine.worker import Engine

torch.set_num_threads(2)


@pytest.fixture(scope="session", autouse=True)
def session_cache(tmp_path_factory):
    """What the tests' servers and loaders convert and measure (TORNCHAT_CACHE) is kept in a directory of the
    session's own, not the user's: speculation's costs measured while the suite keeps the machine busy were
    recalled by every later start of the user's (a verify of 8 rows at 1.0 step, 2026-12-08)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORNCHAT_CACHE", str(tmp_path_factory.mktemp("tornchat-cache")))
        yield


@pytest.fixture(scope="module")
def server():
    """The real server on the embedded model, one per test module; a module overrides it for flags of its own."""
    with servers.running() as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    """The official OpenAI SDK on the module's server."""
    return openai.OpenAI(base_url=server.api_url, api_key="unused", max_retries=0, timeout=600)


@pytest.fixture(scope="session")
def smol_dir() -> str:
    """The embedded default model as a HF directory (converted from its GGUF once per test session)."""
    return str(checkpoint.resolve(None))


@pytest.fixture(scope="session")
def smol(smol_dir) -> checkpoint.Loaded:
    return checkpoint.load(smol_dir)


@pytest.fixture(scope="session")
def tokenizer(smol):
    return smol.tokenizer


@pytest.fixture(scope="session")
def marker_tokenizer(tokenizer):
    """SmolLM2's vocabulary plus Llama's and Mistral's tool-call markers as special tokens, as their own tokenizers have them."""
    tok = copy.deepcopy(tokenizer)  # copy.copy would share the backend, and add the tokens to every test's tokenizer
    tok.backend_tokenizer.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in ("<|python_tag|>", "[TOOL_CALLS]", "[ARGS]")])
    return tok


@pytest.fixture(scope="session")
def marker_compiler(marker_tokenizer):
    return Compiler(marker_tokenizer)


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    """2-layer Llama with random weights over SmolLM2's vocabulary: fast, deterministic."""
    return tiny_llama(len(tokenizer))


def tiny_llama(vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


def make_engine(model, tokenizer, kv_slots=4, kv_bytes=1 << 30, max_queue=16) -> Engine:
    runner = HFRunner(model)
    stops = prompt.stop_token_ids(tokenizer, getattr(model, "generation_config", None))
    return Engine(runner, tokenizer, stops, SlotPool(runner, kv_slots, kv_bytes), max_queue=max_queue)


@pytest.fixture
def tiny_engine(tiny_model, tokenizer):
    engine = make_engine(tiny_model, tokenizer)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def smol_engine(smol):
    engine = make_engine(smol.model, smol.tokenizer)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_model, tokenizer, tmp_path_factory) -> str:
    """tiny_model as a HF directory, for server processes that need a fast model, not a good one.

    Its context is widened to 4096 so that one generation can run for seconds
    (random weights rarely emit end-of-turn).
    """
    path = tmp_path_factory.mktemp("tiny-checkpoint")
    tiny_model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    return str(path)


@pytest.fixture(scope="session")
def tiny_qwen2():
    """Qwen2 differs from Llama by q/k/v biases, which the fused QKV must carry in RoPE order."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    config = Qwen2Config(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=600, use_sliding_window=False,
    )
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


@pytest.fixture(scope="session")
def tiny_qwen3():
    """Qwen3 norms each query and key head before RoPE, and its head_dim times heads is not its hidden size."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(2)
    config = Qwen3Config(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=600, use_sliding_window=False,
    )
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # norm weights away from 1, different per dimension: their order must be right
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="session")
def tiny_gemma3():
    """Gemma 3: windowed layers (8 positions, RoPE base 10000) around a global one (base 1e6, linear scaling),
    norms of (1 + weight) before and after attention and the MLP, per-head q/k norms, GELU gating, embeddings
    scaled by sqrt(hidden), queries by a query_pre_attn_scalar that is not head_dim."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(3)
    config = Gemma3TextConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=600, sliding_window=8, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
    )
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():  # Gemma's norm weights start at 0 (a scale of 1): away from it, different per dimension
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(-0.5, 0.5)
    return model


@pytest.fixture(scope="session")
def tiny_qwen3_moe():
    """Qwen3 MoE: Qwen3's attention, and every MLP a mixture of 8 experts of which each token takes 3."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(3)
    config = Qwen3MoeConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=3, norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, max_position_embeddings=600, use_sliding_window=False,
    )
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.uniform_(0.5, 1.5)
            layer.mlp.gate.weight.normal_(0, 0.5)  # a router of zeros (its initial weights) ties every expert
    return model


@pytest.fixture(scope="session")
def chromium():
    """Debian's Chromium under Playwright; the browser tests skip, saying why, on a machine without it."""
    import browser

    reason = browser.missing()
    if reason:
        pytest.skip(reason)
    with browser.launched() as launched:
        yield launched
