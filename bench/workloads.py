"""The benchmark's conversations: the same messages for every system, sized with the model's tokenizer.

Every conversation starts with an explicit system message: SmolLM2's chat
template inserts a default one otherwise, and a server that formats the chat
its own way may not (llama-cpp-python's ChatML formatter does not; llama-server
runs with --jinja, the file's own template), so only an explicit one gives
every server the same prompt text.
"""
import random
from dataclasses import dataclass

from tornchat import prompt

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


def long_messages(repeat: int, target_tokens: int, tokenizer) -> list[dict]:
    """A question after about target_tokens of field notes, its own per repeat: decoding over a long cache."""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user_message(100 + repeat, target_tokens, tokenizer)}]


def chat_user_messages(workload: Workload, tokenizer) -> list[str]:
    return [user_message(turn, workload.user_tokens, tokenizer) for turn in range(workload.turns)]


def prompt_tokens(messages: list[dict], tokenizer) -> int:
    """Prompt length as the model's own chat template renders it: the same yardstick for every system."""
    return len(prompt.encode(tokenizer, prompt.render(tokenizer, messages)))


# Speculative decoding (bench/speculate.py): replies that copy text from their prompt, where prompt-lookup
# drafts are right, and free chat, where they are not. Made-up texts, so no server has seen them.

CODE_EDIT_FUNCTION = '''\
def summarize_orders(orders, tax_rate=0.2, min_total=0.0):
    """Group orders by customer and return one line of text per customer.

    Each order is a dict with the keys "customer", "items" and "status".
    Cancelled orders are skipped; refunded ones count as negative amounts.
    """
    if not orders:
        return "No orders."

    totals = {}
    counts = {}
    for order in orders:
        status = order.get("status", "open")
        if status == "cancelled":
            continue
        customer = order["customer"].strip().lower()
        amount = 0.0
        for item in order["items"]:
            price = float(item["price"])
            quantity = int(item.get("quantity", 1))
            if quantity < 0:
                raise ValueError(f"negative quantity in order for {customer}")
            discount = float(item.get("discount", 0.0))
            amount += price * quantity * (1.0 - discount)
        if status == "refunded":
            amount = -amount
        totals[customer] = totals.get(customer, 0.0) + amount
        counts[customer] = counts.get(customer, 0) + 1

    lines = []
    for customer in sorted(totals):
        net = totals[customer]
        if abs(net) < min_total:
            continue
        tax = net * tax_rate
        gross = net + tax
        average = net / counts[customer]
        lines.append(
            f"{customer}: {counts[customer]} orders, "
            f"net {net:.2f}, tax {tax:.2f}, gross {gross:.2f}, "
            f"average {average:.2f}"
        )

    if not lines:
        return "No customers above the minimum total."

    grand_net = sum(totals.values())
    grand_tax = grand_net * tax_rate
    header = (
        f"{len(lines)} customers, "
        f"net {grand_net:.2f}, tax {grand_tax:.2f}, "
        f"gross {grand_net + grand_tax:.2f}"
    )
    biggest = max(totals, key=totals.get)
    smallest = min(totals, key=totals.get)
    footer = (
        f"largest customer: {biggest} ({totals[biggest]:.2f}); "
        f"smallest customer: {smallest} ({totals[smallest]:.2f})"
    )
    return "\\n".join([header, *lines, footer])
'''

CODE_EDIT_PROMPT = (
    "Here is a Python function:\n\n```python\n{code}```\n\n"
    "Rename the variable `totals` to `net_by_customer` everywhere in the function and change nothing else. "
    "Reply with the whole rewritten function in one Python code block."
)

SUMMARY_DOCUMENT = """\
The Harwick Valley water board met on the fourth of March to review the winter season and to plan the repairs for the coming year. The chair opened the meeting by noting that the reservoir had reached ninety-two percent of its capacity by the end of February, the highest level recorded since the new dam was finished eleven years ago. She thanked the maintenance crew for clearing the inflow channels after the January storms, which had carried an unusual amount of gravel and fallen branches into the upper basin.

The chief engineer then presented the results of the pipe survey. Of the forty-one kilometres of main pipe inspected since October, six kilometres were found to be in poor condition, most of them in the old town district where the cast iron pipes date from before the war. He reported that leaks in this district account for roughly one third of all water lost between the treatment plant and the customers' meters. The board agreed that replacing the old town pipes must be the first priority of the repair programme, even though the work will close several streets for up to three months.

The treasurer explained that the repair programme would cost about four point two million, of which the regional fund would cover forty percent. The remaining sixty percent would come from the board's reserve and from a small increase in the water rate. She proposed that the rate rise by three percent in July and by another two percent the following January, so that no household would see a sudden jump in its bill. Two members objected that families on low incomes would struggle with any rise at all. After a long discussion the board voted to create a hardship discount for households that already receive the regional heating allowance.

The quality officer reported that all monthly samples had met the national standard during the winter. However, she warned that the level of nitrates in the eastern wells had risen slowly for three years in a row, probably because of fertiliser used on the farms above the aquifer. She recommended that the board meet the farmers' association before the spring planting and offer advice on reducing the amount of fertiliser spread near the wells. The board asked her to prepare a short leaflet and to report back in June. One member suggested testing the eastern wells every two weeks instead of every month until the trend is understood, and the board agreed.

Finally, the board discussed the request from the Millbrook school to install drinking fountains in its new sports hall. The members agreed that the fountains would be paid for from the community fund and that the work should be finished before the start of the autumn term. The school will be asked to report any problems with the water pressure in the hall during the first month of use. The meeting closed at nine in the evening, and the next meeting was set for the second of June.
"""

SUMMARY_PROMPT = (
    "Summarize the following minutes of a meeting in one paragraph per topic. For every topic, quote the key "
    "sentence from the minutes verbatim, in quotation marks.\n\n{document}"
)

RAG_DOCUMENT = """\
Title: Greenfield Public Library, borrowing rules (revised edition)

Membership. Anyone who lives, works or studies in the county may join the library free of charge. To join, bring a document that shows your name and your current address, such as a utility bill or a rental contract. Children under twelve may join with the signature of a parent or guardian. Members receive a card that must be shown every time they borrow an item.

Loan periods. Books may be borrowed for three weeks and may be renewed twice, online or at the desk, unless another member has reserved them. Films and music recordings may be borrowed for one week and cannot be renewed. Magazines may be borrowed for one week, except the current issue, which must be read in the library. Members may have at most fifteen items on loan at the same time, of which no more than five may be films.

Late returns. A late fee of twenty cents per day is charged for each book returned after its due date, up to a maximum of five euros per book. Films are charged one euro per day. No late fees are charged to members under eighteen. If an item is more than six weeks overdue, it is considered lost, and the member is asked to pay for a replacement; the charge is cancelled if the item is returned within a year.

Reservations. Members may reserve up to six items at a time. When a reserved item arrives, the library sends a message by email or text, and the item is kept at the desk for seven days. Reservations for items that must be brought from another branch cost fifty cents each.

Study rooms. The three study rooms on the second floor may be booked for up to three hours a day, at most one week in advance. Groups of more than eight people must use the meeting hall instead, which is booked through the front office.
"""

RAG_PROMPT = (
    "Answer the question using only the document below. Quote the passage that gives the answer verbatim, then "
    "explain it in your own words.\n\nDocument:\n{document}\n\nQuestion: I returned a film four days late and a "
    "book ten days late. I am 35 years old. How much do I owe, and which rules say so?"
)

FREE_CHAT_PROMPT = (
    "I want to start running in the mornings but I always give up after a week. "
    "What would you suggest, and why do habits like this usually fail?"
)


@dataclass
class SpeculationWorkload:
    name: str
    messages: list[dict]
    prediction: str | None = None  # OpenAI Predicted Outputs' content, where the client knows the likely reply
    # The prediction is the reply tornchat --speculate none gave to the same request, same mode: every draft
    # right, the most a verify can give on this machine (a random-weight model copies nothing by itself).
    predict_reply: bool = False


def speculation_workloads() -> list[SpeculationWorkload]:
    """Each with an explicit system message (see above). The code edit is sent three times: as is, with the
    original function as the request's `prediction`, which only tornchat accepts, and with the reply itself
    as the prediction (``predict_reply``)."""
    def messages(user: str) -> list[dict]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]

    code_edit = messages(CODE_EDIT_PROMPT.format(code=CODE_EDIT_FUNCTION))
    return [
        SpeculationWorkload("code edit", code_edit),
        SpeculationWorkload("code edit + prediction", code_edit, prediction=CODE_EDIT_FUNCTION),
        SpeculationWorkload("code edit + its reply as prediction", code_edit, predict_reply=True),
        SpeculationWorkload("summary quoting its source", messages(SUMMARY_PROMPT.format(document=SUMMARY_DOCUMENT))),
        SpeculationWorkload("answer from a document", messages(RAG_PROMPT.format(document=RAG_DOCUMENT))),
        SpeculationWorkload("free chat", messages(FREE_CHAT_PROMPT)),
    ]
