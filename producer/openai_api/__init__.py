"""OpenAI's completion shapes for mlxq jobs: request bodies in, response bodies out.

One mapping for every front end that speaks OpenAI (``mlxq serve``, ``mlxq run-batch``):

- :func:`parse_request`: a ``/v1/chat/completions`` or ``/v1/completions`` body -> an
  :class:`OpenAIRequest` whose ``submit`` map is checked :meth:`Client.submit` arguments;
- :func:`completion_body`: a job's :class:`Result` -> a ``chat.completion`` /
  ``text_completion`` object;
- :class:`ChunkFormatter`: a job's :class:`Chunk` stream -> ``chat.completion.chunk`` /
  ``text_completion`` chunk objects, framed by :func:`sse`;
- :func:`error_body`: OpenAI's ``{"error": {"message", "type", "param", "code"}}``.
"""

from mlxq.producer.openai_api.request import (
    CHAT,
    COMPLETIONS,
    DEFAULT_TIER,
    ENDPOINTS,
    SERVICE_TIERS,
    OpenAIRequest,
    parse_request,
    submit_supports,
)
from mlxq.producer.openai_api.response import (
    SSE_DONE,
    ChunkFormatter,
    completion_body,
    completion_id,
    error_body,
    logprobs_body,
    sse,
    usage_body,
)

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "DEFAULT_TIER",
    "ENDPOINTS",
    "SERVICE_TIERS",
    "SSE_DONE",
    "ChunkFormatter",
    "OpenAIRequest",
    "completion_body",
    "completion_id",
    "error_body",
    "logprobs_body",
    "parse_request",
    "sse",
    "submit_supports",
    "usage_body",
]
