"""``mlxq worker``'s start-up checks, each refusing with one line that says what to do: the
model path (before MLX loads anything), Redis (reachable, no cluster, the worker's user
allowed every command, key and channel the worker uses), and that live workers of its
queues serve the same model. Importing this module needs no MLX.
"""

from __future__ import annotations

import logging
from pathlib import Path

from mlxq.producer.errors import SetupError
from mlxq.worker import config as c

log = logging.getLogger("mlxq.worker")


def model_problem(model: str) -> str | None:
    """Why ``model`` cannot be loaded, as far as the file system tells; None when it may
    (a model directory, or what reads as a Hugging Face repo id)."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            return (
                f"model directory {model} has no config.json, so it is no mlx-lm model: "
                "give a model directory (`mlxq model tiny DIR` writes a test model) or a "
                "Hugging Face repo id"
            )
        return None
    if path.exists():
        return f"model {model} is a file: give a model directory or a Hugging Face repo id"
    # A repo id is "name" or "org/name"; anything else is a path that is not there.
    if model.startswith((".", "/", "~")) or model.count("/") > 1 or "\\" in model:
        return f"no model directory {model}: check the path, or give a Hugging Face repo id"
    return None


def load_problem(model: str, e: Exception) -> str:
    from huggingface_hub import errors as hf

    if isinstance(e, (hf.RepositoryNotFoundError, hf.GatedRepoError)):
        return (
            f"model {model!r}: Hugging Face has no such repo, or it is private: check the "
            "repo id (org/name), or give a local model directory"
        )
    if isinstance(e, (hf.LocalEntryNotFoundError, hf.OfflineModeIsEnabled)):
        return (
            f"model {model!r} is no local directory and cannot be downloaded (Hugging Face "
            "unreachable or offline mode): check the name, or download it first "
            f"(hf download {model})"
        )
    if isinstance(e, hf.HFValidationError):
        return f"model {model!r} is neither a local directory nor a Hugging Face repo id"
    first = (str(e).strip().splitlines() or [""])[0]
    return f"cannot load model {model!r}: {type(e).__name__}: {first}"


def check_redis(config: c.WorkerConfig) -> None:
    """Redis answers, and lets the worker's user do all the worker does (ACLs)."""
    import redis

    from mlxq.producer.connection import connect, problem
    from mlxq.producer.sentinel import cluster_problem
    from mlxq.worker.access import lacking, user_of

    url = config.redis_url
    client = connect(url, retries=0)
    try:
        client.ping()
        if (refused := cluster_problem(client)) is not None:
            raise SetupError(refused)
        missing = lacking(client, config.worker_name, config.levels.queues, config.wait_replicas)
    except redis.RedisError as e:
        raise SetupError(problem(url, e)) from e
    finally:
        client.close()
    if missing:
        raise SetupError(missing.text(user_of(client)))
    lacks: dict[str, list[str]] = {}
    for command, without in missing.optional.items():
        lacks.setdefault(without, []).append(command)
    for without, commands in lacks.items():
        log.warning(
            "Redis user %r may not run %s: %s", user_of(client), ", ".join(commands), without
        )


def digest_of(model: str) -> str | None:
    """The model's fingerprint, to compare with other workers'; None when unreadable."""
    from mlxq.worker.identity import model_digest

    try:
        return model_digest(model)
    except OSError as e:  # unreadable: the load says so; compared with nothing
        log.warning(
            "could not fingerprint model %s (%s): not compared with other workers", model, e
        )
        return None


def check_model(config: c.WorkerConfig, digest: str) -> None:
    """Refuse to start while live workers of its queues serve another model, unless told.

    Raises:
        SetupError: they do (naming them), or Redis cannot be reached.
    """
    import redis

    from mlxq.producer.connection import connect, problem
    from mlxq.worker.identity import mismatch_text, mismatches

    client = connect(config.redis_url, retries=0)
    try:
        others = mismatches(client, config.worker_name, config.levels.queues, digest)
    except redis.RedisError as e:
        raise SetupError(problem(config.redis_url, e)) from e
    finally:
        client.close()
    if others and not config.allow_mixed_models:
        raise SetupError(mismatch_text(config.model, digest, others))
    if others:
        log.warning(
            "serving anyway (--allow-mixed-models): %s", mismatch_text(config.model, digest, others)
        )
