"""A scripted user who likes one reply style, and the rule-based judge that reads its next messages.

The user asks short questions in sessions of a few turns. A reply that starts with "Yes" is accepted (the next
message thanks the assistant and asks the next question); any other reply is corrected ("No, I do not like replies
like that."), without saying what it wanted. :func:`judge` is what a process reward model would conclude from the
next state: a correction scores -1 with the hint :data:`HINT`, anything else +1.

The tiny test model knows no English, so :func:`warm_up` first teaches it the two styles in a few seconds of
supervised steps: without a hint it answers "Yes ..." or "No ..." about evenly; with the hint appended to the user's
message (as the trainer's teacher sees it) it answers "Yes ...". Learning from the next state should then move the
unhinted model toward "Yes".
"""

from __future__ import annotations

import random
from collections.abc import Iterator

#: What the judge says the assistant should have known (longer than 10 characters, as every kept hint).
HINT = "Start the reply with the word Yes."
#: The trainer's hint separator (reef_openclaw.trainer.HINT_PREFIX), repeated so the corpus needs no torch import.
HINT_PREFIX = "\n\n[user's hint / instruction]\n"
THANKS = "Thanks."
CORRECTION = "No, not like that."
_WORDS = ("Paris", "the sum", "the list", "the city", "the value", "the code", "the result", "the word", "the score",
          "the step")


def question(rng: random.Random) -> str:
    """One short question."""
    return f"Is {rng.choice(_WORDS)} right?"


def accepted(reply: str) -> bool:
    """Whether the scripted user accepts a reply."""
    return reply.strip().lower().startswith("yes")


def next_message(reply: str, rng: random.Random) -> str:
    """The user's next message after ``reply``: thanks or a correction, then the next question."""
    return f"{THANKS if accepted(reply) else CORRECTION} {question(rng)}"


def judge(*, turn: dict, next_state: dict) -> dict:
    """The ``callable`` judge of this user: a correction is -1 with a hint, anything else +1."""
    if str(next_state.get("content", "")).startswith(CORRECTION):
        return {"score": -1.0, "hint": HINT}
    return {"score": 1.0, "hint": None}


def sessions(seed: int, turns_per_session: int = 3) -> Iterator[tuple[str, int, str]]:
    """``(session id, turn index, first question)`` forever; the question of later turns comes from
    :func:`next_message`."""
    rng = random.Random(seed)
    n = 0
    while True:
        sid = f"s{seed}-{n}"
        for t in range(turns_per_session):
            yield sid, t, question(rng)
        n += 1


# -- supervised warm-up of the tiny model ---------------------------------------------------------------------------


def _reply(style: str, rng: random.Random) -> str:
    return f"{style}, {rng.choice(_WORDS)}"


def corpus(n: int, seed: int = 0, turns_per_session: int = 3) -> list[tuple[list[dict], str]]:
    """``(messages, reply)`` pairs: unhinted prompts answered "Yes" or "No" evenly, hinted ones always "Yes"."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        messages: list[dict] = []
        for _ in range(turns_per_session):
            if messages:
                last = messages[-1]["content"]
                messages.append({"role": "user", "content": f"{THANKS if accepted(last) else CORRECTION} "
                                                            f"{question(rng)}"})
            else:
                messages.append({"role": "user", "content": question(rng)})
            hinted = rng.random() < 0.5
            prompt = [dict(m) for m in messages]
            if hinted:
                prompt[-1]["content"] += HINT_PREFIX + HINT
            style = "Yes" if hinted or rng.random() < 0.5 else "No"
            reply = _reply(style, rng)
            out.append((prompt, reply))
            messages.append({"role": "assistant", "content": reply if not hinted else _reply(
                rng.choice(("Yes", "No")), rng)})
    return out[:n]


def warm_up(model, tokenizer, *, steps: int = 60, batch: int = 16, lr: float = 1e-2, seed: int = 0) -> dict:
    """Supervised steps on :func:`corpus` (reply tokens only); returns ``{"loss": last loss}``."""
    import torch

    rows = []
    for messages, reply in corpus(2048, seed=seed):
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        r = tokenizer(reply + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        rows.append((p, r))
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss = None
    for _ in range(steps):
        pick = torch.randint(len(rows), (batch,), generator=gen).tolist()
        width = max(len(rows[i][0]) + len(rows[i][1]) for i in pick)
        ids = torch.full((batch, width), tokenizer.pad_token_id, dtype=torch.long)
        labels = torch.full((batch, width), -100, dtype=torch.long)
        attn = torch.zeros((batch, width), dtype=torch.long)
        for b, i in enumerate(pick):
            p, r = rows[i]
            seq = p + r
            ids[b, :len(seq)] = torch.tensor(seq)
            attn[b, :len(seq)] = 1
            labels[b, len(p):len(seq)] = torch.tensor(r)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return {"loss": float(loss.detach()) if loss is not None else None}


def write_warm_model(path, *, seed: int = 0, steps: int = 100, batch: int = 32, lr: float = 3e-3) -> dict:
    """Build the tiny model, :func:`warm_up` it and save it (weights, tokenizer, chat template) to ``path``, a
    directory ``engine.model`` can name. Returns the warm-up's summary."""
    import json
    from pathlib import Path

    import torch

    from reef_core.api import build_tiny_model, build_tiny_tokenizer

    path = Path(path)
    model, tok = build_tiny_model(seed=seed, tokenizer=build_tiny_tokenizer())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        summary = warm_up(model, tok, steps=steps, batch=batch, lr=lr, seed=seed)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    # a qwen2 model's tokenizer as every transformers version loads it (see reef_core's tiny model)
    config = path / "tokenizer_config.json"
    data = json.loads(config.read_text())
    data["tokenizer_class"] = "Qwen2Tokenizer"
    config.write_text(json.dumps(data, indent=2))
    return summary
