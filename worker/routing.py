"""Which worker a chat turn belongs to: the one whose prompt cache holds its history.

Each worker keeps its own prompt cache, and a chat resends its whole history every turn,
so a turn claimed by another worker than the one that made the last reply prefills that
history again. When a chat job finishes, its worker names itself under the conversation
so far (the messages plus the reply, as the client will send them back); a worker that
claims a job whose history (every message but the last) is so named hands it to that
worker, should it be live and have free rows (:mod:`mlxq.worker.bridge`'s ``hand``).

The key is a digest of the messages' roles, names and texts, so it takes no tokenizer
and holds no text. Raw-prompt jobs are not routed: a sweep's shared prefix is prefilled
once by each worker anyway, and routing it would pile a sweep on one worker.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

from mlxq.producer import keys
from mlxq.producer.params import GenerationRequest


def conversation_key(queue: str, messages: Sequence[dict[str, str]]) -> str:
    """The route key of a conversation: a digest of its messages, in order."""
    h = hashlib.sha256()
    for m in messages:
        row = [m["role"], m.get("name", ""), m["content"]]
        h.update(json.dumps(row, ensure_ascii=False).encode("utf-8", "surrogatepass") + b"\n")
    return keys.route_key(queue, h.hexdigest()[:32])


def continues(queue: str, req: GenerationRequest) -> str | None:
    """The route key of the conversation a chat job continues (its messages up to a
    reply), or None when it continues none."""
    m = req.messages
    if m is None or len(m) < 2 or m[-2]["role"] != "assistant":
        return None
    return conversation_key(queue, m[:-1])


def finished_as(queue: str, req: GenerationRequest, reply: str) -> str | None:
    """The route key a chat job's next turn will look up, once it replied ``reply``;
    None for a raw prompt or several choices (the client keeps one of them)."""
    if req.messages is None or req.n != 1:
        return None
    return conversation_key(queue, (*req.messages, {"role": "assistant", "content": reply}))
