"""The end-of-step kernels (through Triton's interpreter on the CPU) against their PyTorch references, the sampler,
and the stop matchers."""
import os

import torch

# Compiled kernels on a GPU; elsewhere Triton's interpreter runs them on CPU
# tensors. The interpreter is chosen at @triton.jit, so before kernel imports.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import random  # noqa: E402

import pytest  # noqa: E402

from tornchat.kernels import sample, step_choice  # noqa: E402
from tornchat.kernels import step_choice_triton as kernel  # noqa: E402
from tornchat.kernels.stopcheck import MAX_STOP_STRINGS, build_stop_table, stop_hit_reference  # noqa: E402
from test_kernels_stopcheck import TOY_VOCAB  # noqa: E402 (its pieces cross the stop strings' boundaries)

ID = {piece: i for i, piece in enumerate(TOY_VOCAB)}
STOPS = ["stop", "pp", "é!", "sts"]
EOS = ID[b"a"]


def awkward_rows(vocab: int = 300) -> tuple[torch.Tensor, dict[int, int]]:
    """Rows of logits [11, vocab] (ties across blocks of 64, non-finite values), and the ids known for some."""
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(11, vocab, generator=gen) * 3
    rows[1, ::7] = float("nan")
    rows[1, 5] = float("nan")
    rows[2, 100] = float("inf")
    rows[2, 70] = 3e38  # finite but past the cap: ties with +inf there, and has the lower id
    rows[2, 200] = float("inf")
    rows[3] = float("-inf")
    rows[3, vocab - 1] = 0.5  # the lone finite value, in the last, partial block
    rows[4] = float("-inf")  # no finite logit: token 0
    rows[5] = float("nan")
    rows[6, ::2], rows[6, 1::2] = float("nan"), float("-inf")
    rows[7] = torch.randint(0, 4, (vocab,), generator=gen).float()
    rows[7, [64, 128, vocab - 1]] = 5.0  # the first id of a block
    rows[8] = torch.randint(0, 4, (vocab,), generator=gen).float()
    rows[8, [63, 64]] = 5.0  # either side of a block boundary
    rows[9] = torch.randint(0, 4, (vocab,), generator=gen).float()  # ties everywhere
    rows[10] = float("-inf")
    rows[10, [10, 20, 100]] = torch.tensor([-0.0, 0.0, 0.0])  # -0.0 == 0.0
    return rows.to(DEVICE), {2: 70, 3: vocab - 1, 4: 0, 5: 0, 6: 0, 7: 64, 8: 63, 10: 10}


def temperature_zero_sample(logits: torch.Tensor) -> list[int]:
    """``kernels.sample``'s ids at temperature 0."""
    rows = logits.shape[0]
    ids, _ = sample(logits, torch.zeros(rows), torch.zeros(rows, dtype=torch.int64), torch.ones(rows),
                    torch.zeros(rows, dtype=torch.int64), step=0)
    return ids.tolist()


@pytest.mark.parametrize("block", [None, 64, 256])
def test_greedy_takes_the_samplers_greedy_token(block):
    logits, known = awkward_rows()
    expected = temperature_zero_sample(logits)
    assert step_choice.greedy_ref(logits).tolist() == expected
    assert all(expected[row] == token for row, token in known.items())
    ids = kernel.greedy(logits, block=block)
    assert ids.dtype == torch.int64 and ids.tolist() == expected
    assert kernel.greedy(logits[:3], block=block).tolist() == expected[:3]  # M = 3
    assert [int(kernel.greedy(logits[r : r + 1], block=block)) for r in known] == list(known.values())  # M = 1


@pytest.mark.parametrize("vocab", [1, 64, 65, 1000])
def test_greedy_on_random_rows_of_any_vocabulary(vocab):
    logits = (torch.randn(3, vocab, generator=torch.Generator().manual_seed(vocab)) * 2).to(DEVICE)
    logits[2] = logits[2].round()  # ties
    expected = step_choice.greedy_ref(logits).tolist()
    for block in (None, 64):
        assert kernel.greedy(logits, block=block).tolist() == expected


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_greedy_of_half_precision_logits_compares_them_in_fp32(dtype):
    logits, _ = awkward_rows()
    logits = logits.to(dtype)
    assert kernel.greedy(logits, block=64).tolist() == temperature_zero_sample(logits)


def buffers(rows: int, width: int) -> dict[str, torch.Tensor]:
    """A reply's state before its first generated token: window all -1."""
    return {
        "tokens": torch.zeros(rows, dtype=torch.int64, device=DEVICE),
        "positions": torch.arange(rows, dtype=torch.int64, device=DEVICE) * 10 + 5,
        "index": torch.tensor([7], dtype=torch.int32, device=DEVICE),
        "window": torch.full((rows, width), -1, dtype=torch.int64, device=DEVICE),
        "out": torch.zeros(rows, 2, dtype=torch.int64, device=DEVICE),
    }


def run(advance, streams: list[list[int]], table, width: int = step_choice.WINDOW):
    """Feed each row its stream one id a call; yields the buffers (copied) after each call."""
    state = buffers(len(streams), width)
    for step in range(len(streams[0])):
        ids = torch.tensor([stream[step] for stream in streams], device=DEVICE)
        advance(ids, state["tokens"], state["positions"], state["index"], state["window"], table, state["out"])
        yield {name: tensor.clone() for name, tensor in state.items()}


def host_finished(stream: list[int], stops=STOPS, eos=EOS) -> list[bool]:
    """Per token of a reply: is it EOS, or does a stop string occur in the decoded text, ending inside it?"""
    text, flags = b"", []
    for token in stream:
        start = len(text)
        text += TOY_VOCAB[token]
        flags.append(token == eos or any(text.find(s.encode(), max(0, start - len(s.encode()) + 1)) >= 0
                                         for s in stops))
    return flags


def random_streams(rows: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(len(TOY_VOCAB)) for _ in range(length)] for _ in range(rows)]


def test_advance_matches_the_reference_and_the_decoded_text_step_by_step():
    """70 steps of 3 rows over a window of WINDOW = 63 ids: the oldest ids fall out of it, and stop strings
    cross token boundaries."""
    table = step_choice.padded_table(build_stop_table(TOY_VOCAB, STOPS, [EOS], device=DEVICE))
    streams = random_streams(3, 70, seed=0)
    got = list(run(kernel.advance, streams, table))
    expected = list(run(step_choice.advance_ref, streams, table))
    for step, (state, reference) in enumerate(zip(got, expected)):
        for name in state:
            assert torch.equal(state[name], reference[name]), (step, name)
        assert state["out"][:, 1].tolist() == [stop_hit_reference(row, table) for row in state["window"].tolist()]
    last = got[-1]
    assert last["index"].tolist() == [7 + 70]  # once a step, whatever the rows
    assert last["positions"].tolist() == [75, 85, 95] and last["tokens"].tolist() == [s[-1] for s in streams]
    assert last["window"].tolist() == [s[-step_choice.WINDOW :] for s in streams]
    assert got[0]["window"][:, :-1].eq(-1).all()
    finished = [[bool(state["out"][r, 1]) for state in got] for r in range(3)]
    assert finished == [host_finished(stream) for stream in streams]
    flat = sum(finished, [])
    assert 0.1 < sum(flat) / len(flat) < 0.9  # both outcomes well represented
    assert [[int(state["out"][r, 0]) for state in got] for r in range(3)] == streams


@pytest.mark.parametrize("stops", [STOPS[:2], []])
def test_a_padded_table_finishes_the_same_rows(stops):
    table = build_stop_table(TOY_VOCAB, stops, [EOS], device=DEVICE)
    padded = step_choice.padded_table(table)
    assert padded.final.shape == (MAX_STOP_STRINGS, len(TOY_VOCAB)) and padded.final[len(stops) or 1 :].eq(0).all()
    streams = random_streams(2, 12, seed=len(stops))
    alone = [state["out"] for state in run(kernel.advance, streams, table, width=8)]
    in_padding = [state["out"] for state in run(kernel.advance, streams, padded, width=8)]
    assert all(torch.equal(a, b) for a, b in zip(alone, in_padding))
    assert [[bool(out[r, 1]) for out in alone] for r in range(2)] == [host_finished(s, stops) for s in streams]
    with pytest.raises(ValueError):
        step_choice.padded_table(padded, 2)


@pytest.mark.parametrize("width", [4, step_choice.WINDOW])
def test_nothing_before_the_first_token_counts(width):
    """"to", "p" completes "stop" only after a generated "s": the -1 padding is no token (id 0 is "s")."""
    table = step_choice.padded_table(build_stop_table(TOY_VOCAB, ["stop"], [EOS], device=DEVICE))
    pieces = [[b"to", b"p", b"s"], [b"s", b"to", b"p"]]
    got = list(run(kernel.advance, [[ID[p] for p in row] for row in pieces], table, width))
    assert [[int(state["out"][r, 1]) for state in got] for r in range(2)] == [[0, 0, 0], [0, 0, 1]]
    assert got[0]["window"].tolist() == [[-1] * (width - 1) + [ID[b"to"]], [-1] * (width - 1) + [ID[b"s"]]]


def test_an_id_past_the_tables_vocabulary_finishes_nothing_and_cuts_the_match():
    """Logits wider than the tokenizer's vocabulary: their extra ids count as -1 in the check."""
    table = step_choice.padded_table(build_stop_table(TOY_VOCAB, ["stop"], [EOS], device=DEVICE))
    beyond = len(TOY_VOCAB) + 3
    streams = [[ID[b"st"], beyond, ID[b"op"]], [ID[b"st"], ID[b""], ID[b"op"]]]
    got = [state["out"][:, 1].tolist() for state in run(kernel.advance, streams, table, width=4)]
    assert got == [[0, 0], [0, 0], [0, 1]]
    expected = [state["out"][:, 1].tolist() for state in run(step_choice.advance_ref, streams, table, width=4)]
    assert got == expected


def test_a_step_chooses_then_advances():
    """greedy's ids feed advance directly, as at the end of a captured step."""
    table = step_choice.padded_table(build_stop_table(TOY_VOCAB, STOPS, [EOS], device=DEVICE))
    gen = torch.Generator().manual_seed(9)
    logits = [(torch.randn(2, 40, generator=gen)).to(DEVICE) for _ in range(6)]  # ids past the table's 20 too
    results = []
    for choose, advance in ((kernel.greedy, kernel.advance), (step_choice.greedy_ref, step_choice.advance_ref)):
        state = buffers(2, 8)
        for step_logits in logits:
            advance(choose(step_logits), state["tokens"], state["positions"], state["index"], state["window"], table,
                    state["out"])
        results.append(state)
    for name in results[0]:
        assert torch.equal(results[0][name], results[1][name]), name


def test_dispatch_sends_cuda_tensors_and_requested_cpu_tensors_to_the_kernels(monkeypatch):
    """greedy() and advance() run the kernels on CUDA (or on CPU with TORNCHAT_TRITON_INTERPRET=1), the references
    on CPU."""
    calls = []
    for name in ("greedy", "advance"):
        original = getattr(kernel, name)
        monkeypatch.setattr(kernel, name, lambda *args, _run=original, _name=name: calls.append(_name) or _run(*args))

    def choose_and_advance(device: str) -> list[list[int]]:
        logits, _ = awkward_rows()
        logits[0, EOS] = 100.0
        state = {name: tensor.to(device) for name, tensor in buffers(logits.shape[0], 4).items()}
        table = build_stop_table(TOY_VOCAB, STOPS, [EOS], device=device)
        ids = step_choice.greedy(logits.to(device))
        step_choice.advance(ids, state["tokens"], state["positions"], state["index"], state["window"], table,
                            state["out"])
        return state["out"].tolist()

    if DEVICE == "cpu":
        monkeypatch.setenv("TORNCHAT_TRITON_INTERPRET", "1")
    on_device = choose_and_advance(DEVICE)
    assert calls == ["greedy", "advance"] and on_device[0] == [EOS, 1]
    monkeypatch.delenv("TORNCHAT_TRITON_INTERPRET", raising=False)
    assert choose_and_advance("cpu") == on_device and calls == ["greedy", "advance"]


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_a_captured_graph_chooses_and_advances_at_every_replay():
    """Captured once, replayed over new logits: every value that changes lives in the buffers."""
    table = step_choice.padded_table(build_stop_table(TOY_VOCAB, STOPS, [EOS], device=DEVICE))
    rows, vocab, steps = 3, 40_000, 12
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    streams = random_streams(rows, steps, seed=5)
    # One-hot-ish logits whose argmax is the stream's id, over a vocabulary wide enough to split into blocks.
    all_logits = torch.randn(steps, rows, vocab, generator=gen, device=DEVICE)
    for step in range(steps):
        for r in range(rows):
            all_logits[step, r, streams[r][step]] = 100.0
    logits = all_logits[0].clone()
    state = buffers(rows, step_choice.WINDOW)
    args = (state["tokens"], state["positions"], state["index"], state["window"], table, state["out"])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside the capture
        kernel.advance(kernel.greedy(logits), *args)
    torch.cuda.current_stream().wait_stream(side)
    for name, tensor in buffers(rows, step_choice.WINDOW).items():
        state[name].copy_(tensor)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel.advance(kernel.greedy(logits), *args)
    for name, tensor in buffers(rows, step_choice.WINDOW).items():  # the capture ran nothing, but be sure
        state[name].copy_(tensor)
    expected = run(step_choice.advance_ref, streams, table)
    for step in range(steps):
        logits.copy_(all_logits[step])
        graph.replay()
        reference = next(expected)
        for name in state:
            assert torch.equal(state[name], reference[name]), (step, name)
