"""A fake tool-calling model for tests: the tiny Qwen2 fine-tuned in-process on a handful of tool-call exchanges.

It is a real model directory (safetensors, tokenizer, a chat template that renders tools, assistant tool calls and
tool results in the Hermes convention that Qwen 2.5 uses), so the local engine serves it exactly as it would serve a
real tool-calling model; only its knowledge is scripted. Greedy, it answers:

* a conversation that offers tools and ends on a user turn: ``<tool_call>`` calling ``echo`` with
  ``{"text": "hello"}``;
* a conversation that ends on a tool result: ``Done.``;
* a conversation without tools: ``Hello.``

Built once per directory (a marker records how), in a few seconds on a CPU.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from reef_core.models.loading import (
    MARKER,
    _check_existing,
    _publish_dir,
    build_tiny_model,
    build_tiny_tokenizer,
    default_tokenizer_texts,
    save_tokenizer,
)

#: Hermes-style tool template (the convention of Qwen 2.5's): tools listed in the system turn, calls as
#: ``<tool_call>`` JSON blocks, results as ``<tool_response>`` blocks in a user turn.
TOOL_CHAT_TEMPLATE = (
    "{% set system = messages[0].content if messages and messages[0].role == 'system' else none %}"
    "{% if tools %}<|im_start|>system\n{% if system %}{{ system }}\n{% endif %}"
    "<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools><|im_end|>\n"
    "{% elif system %}<|im_start|>system\n{{ system }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if loop.first and message.role == 'system' %}"
    "{% elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% elif message.role == 'assistant' %}"
    "<|im_start|>assistant\n{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}"
    "<tool_call>\n{\"name\": \"{{ call.function.name }}\", \"arguments\": {{ call.function.arguments | tojson }}}\n"
    "</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ECHO = {"type": "function", "function": {"name": "echo", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}}}}
CALL = '<tool_call>\n{"name": "echo", "arguments": {"text": "hello"}}\n</tool_call>'
_USER_TEXTS = ("say hello", "use the tool", "first question")
_VERSION = 1


def _examples() -> list[tuple[list[dict], list | None, str]]:
    """(messages, tools, the answer the model learns)."""
    out = []
    call = {"id": "call_1", "type": "function", "function": {"name": "echo", "arguments": {"text": "hello"}}}
    for i, text in enumerate(_USER_TEXTS):
        user = [*([{"role": "system", "content": "Be brief."}] if i == 2 else []), {"role": "user", "content": text}]
        out.append((user, [ECHO], CALL))
        out.append((user, None, "Hello."))
        out.append(([*user, {"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "echoed"}], [ECHO], "Done."))
    return out


def build_fake_tool_model(seed: int = 0, steps: int = 300, hidden_size: int = 64):
    """``(model, tokenizer)``: the tiny model trained, one padded batch of every example per step, until it
    predicts every answer token greedily with a margin. Its four heads are ``hidden_size / 4`` wide: vLLM's CPU
    attention needs 32 or more (``hidden_size=128``)."""
    # The tokenizer learns the tool-call text as few tokens: short rows train fast.
    corpus = [CALL, json.dumps(ECHO), "<tool_response>\n", "</tool_response>", "Done.", "Hello."] * 50
    tok = build_tiny_tokenizer([*default_tokenizer_texts(), *corpus], vocab_size=1024)
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    tok.chat_template = TOOL_CHAT_TEMPLATE
    model, tok = build_tiny_model(seed=seed, tokenizer=tok, hidden_size=hidden_size)
    rows = []
    for messages, tools, answer in _examples():
        prompt = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        a_ids = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows.append((p_ids + a_ids, len(p_ids)))
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100)
    for i, (row, start) in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row)] = 1
        labels[i, start:len(row)] = torch.tensor(row[start:])
    target, scored = labels[:, 1:], labels[:, 1:] != -100
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 0.1 M-parameter model: more threads only wait on each other
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            optim = torch.optim.Adam(model.parameters(), lr=1e-2)
            model.train()
            for _ in range(steps):
                optim.zero_grad()
                logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
                torch.nn.functional.cross_entropy(logits.transpose(1, 2), target).backward()
                optim.step()
                logp = torch.log_softmax(logits.detach(), -1)
                gold = logp.gather(-1, target.clamp(min=0)[..., None])[..., 0]
                if bool((gold[scored] > -0.05).all()):  # every answer token above 95 %: greedy reproduces them
                    break
    finally:
        torch.set_num_threads(threads)
    model.eval()
    return model, tok


def ensure_fake_tool_model(path: Path, seed: int = 0, hidden_size: int = 64) -> Path:
    """Write the fake tool-calling model to ``path`` once (atomically, like the tiny model); return it."""
    path = Path(path)
    expected = {"kind": "fake-tool-model", "seed": seed, "version": _VERSION}
    if hidden_size != 64:  # the default size's marker predates the choice
        expected["hidden_size"] = hidden_size
    if _check_existing(path, expected):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        model, tok = build_fake_tool_model(seed, hidden_size=hidden_size)
        model.save_pretrained(tmp)
        save_tokenizer(tok, tmp, "Qwen2Tokenizer")
        (tmp / MARKER).write_text(json.dumps(expected))
        _publish_dir(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path
