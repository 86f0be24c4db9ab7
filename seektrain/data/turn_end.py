"""Which tokens end a model's turn: where ``seektrain chat`` stops a reply and what an exported
folder's ``generation_config.json`` names as ``eos_token_id``.

EOS always does. A chat template may end an assistant turn with a token of its own (ChatML's
``<|im_end|>``); DeepSeek's templates end it with EOS itself. The turn's end is found the way the loss
mask finds a turn (``chat_template.py``): render a one-turn conversation and read the first token the
template writes after the assistant's content. A blank token there (a template that only puts
newlines between turns) is no end marker, and only EOS stops.
"""

from __future__ import annotations

from seektrain.data.chat_template import ChatTemplate

_PROBE_USER, _PROBE_ANSWER = "ping", "pong"


def stop_token_ids(tokenizer, template: ChatTemplate | None) -> list[int]:
    """EOS first, then the template's end-of-turn token when it has one of its own."""
    stop = [tokenizer.eos_id]
    if template is None:
        return stop
    asked = [{"role": "user", "content": _PROBE_USER}]
    head = template.render(asked, add_generation_prompt=True)
    full = template.render(asked + [{"role": "assistant", "content": _PROBE_ANSWER}])
    at = full.find(_PROBE_ANSWER, len(head) if full.startswith(head) else 0)
    after = full[at + len(_PROBE_ANSWER) :] if at >= 0 else ""
    ids = tokenizer.encode_chat(after)[0] if after else []
    if ids:
        marker = tokenizer.decode(ids[:1])
        if marker.strip() == marker and after.startswith(marker) and ids[0] not in stop:
            stop.append(ids[0])
    return stop
