"""mlxq for producers: submit generation jobs, stream their tokens, read results.

Imports neither MLX nor mlx-lm: it runs in any web backend.
"""

from mlxq.producer.aio import AsyncClient, AsyncJob
from mlxq.producer.client import Client, Job, QueueFull, Result
from mlxq.producer.codec import Chunk
from mlxq.producer.constraints import Constraint
from mlxq.producer.errors import (
    JobFailed,
    JobIdInUse,
    JobTimeout,
    MlxqError,
    NoSuchJob,
    NotReplicated,
    PayloadError,
    QueueBroken,
)
from mlxq.producer.params import GenerationRequest, SamplingParams

__all__ = [
    "AsyncClient",
    "AsyncJob",
    "Chunk",
    "Client",
    "Constraint",
    "GenerationRequest",
    "Job",
    "JobFailed",
    "JobIdInUse",
    "JobTimeout",
    "MlxqError",
    "NoSuchJob",
    "NotReplicated",
    "PayloadError",
    "QueueBroken",
    "QueueFull",
    "Result",
    "SamplingParams",
]
