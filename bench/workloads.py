"""The benchmark's conversations: the same messages for every system, sized with the model's tokenizer.

Every conversation starts with an explicit system message: SmolLM2's chat
template inserts a default one otherwise, and llama.cpp's ChatML formatter
does not, so only an explicit one gives every server the same prompt text.
"""
import random
from dataclasses import dataclass

SYSTEM = "You are a helpful assistant. Answer clearly and in detail."
COLD_SYSTEM = "You are a patient assistant. Answer carefully and completely."  # shares no prefix with SYSTEM

# Three topics of the same shape, so that repeats of the short workload share
# no prompt prefix beyond the system message: no server can answer one from
# the cache of another.
SHORT_TOPICS = ["the printing press", "the steam engine", "the telescope"]
SHORT_PROMPT = (
    "Write a detailed essay about the history of {topic}, "
    "its inventors, and how it changed science, religion and politics in Europe."
)

# Raw material for the chat's long user messages: field notes of a made-up
# project, reshuffled per turn so that no two messages repeat each other.
SUBJECTS = [
    "the bridge survey team", "the river gauge", "the north orchard", "the old mill",
    "the weather station", "the school garden", "the bakery cooperative", "the bus depot",
    "the library archive", "the harbour crane", "the hill vineyard", "the solar array",
]
FINDINGS = [
    "recorded a steady rise in {m} over the last {n} days",
    "reported that {m} dropped by {n} percent after the repairs",
    "asked for a second opinion on the {m} readings from week {n}",
    "found that {m} doubles whenever the wind turns west for {n} hours",
    "logged {n} complaints about {m} since the spring inspection",
    "suggested measuring {m} twice a day for the next {n} weeks",
]
MEASURES = ["water level", "soil moisture", "foot traffic", "power output", "noise", "temperature", "crop yield"]
QUESTIONS = [
    "What are the three most important patterns in these notes, and why?",
    "Which of these notes worry you most? Explain your reasoning step by step.",
    "Summarise the notes above as a short report for the town council.",
    "Which measurements should we repeat first, and what could explain the changes?",
    "Write a plan for next month based on everything above.",
    "Compare this week's notes with the earlier ones and list what changed.",
]


@dataclass
class Workload:
    short_max_tokens: int
    short_repeats: int  # the short workload's figures are medians over this many topics
    turns: int
    turn_max_tokens: int
    user_tokens: int  # length of each chat user message, in tokens


FULL = Workload(short_max_tokens=128, short_repeats=3, turns=6, turn_max_tokens=96, user_tokens=240)
QUICK = Workload(short_max_tokens=32, short_repeats=1, turns=3, turn_max_tokens=24, user_tokens=120)


def short_messages(repeat: int) -> list[dict]:
    topic = SHORT_TOPICS[repeat % len(SHORT_TOPICS)]
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": SHORT_PROMPT.format(topic=topic)}]


def user_message(turn: int, target_tokens: int, tokenizer) -> str:
    """Field notes plus a question, grown note by note until it is about target_tokens long."""
    rng = random.Random(turn)
    question = QUESTIONS[turn % len(QUESTIONS)]
    notes: list[str] = []
    text = question
    while len(tokenizer(text, add_special_tokens=False)["input_ids"]) < target_tokens:
        finding = rng.choice(FINDINGS).format(m=rng.choice(MEASURES), n=rng.randint(2, 40))
        notes.append(f"Note {len(notes) + 1}: {rng.choice(SUBJECTS).capitalize()} {finding}.")
        text = "Here are this week's field notes.\n" + "\n".join(notes) + "\n\n" + question
    return text


def chat_user_messages(workload: Workload, tokenizer) -> list[str]:
    return [user_message(turn, workload.user_tokens, tokenizer) for turn in range(workload.turns)]


def prompt_tokens(messages: list[dict], tokenizer) -> int:
    """Prompt length as the model's own chat template renders it: the same yardstick for every system."""
    return len(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"])
