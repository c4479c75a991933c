"""Every Redis key and channel name mlxq uses, rq's included, and the shared defaults.

rq owns its keys (``rq:queue:<name>``, ``rq:job:<id>``, its registries); mlxq reads
and writes them in bulk from Lua scripts, so their names are taken from rq's own
classes here, once, and a test holds them equal. mlxq's own keys sit under ``mlxq:``.
"""

from __future__ import annotations

from rq.defaults import RQ_KEY_PREFIX
from rq.executions import WORKER_EXECUTIONS_KEY_TEMPLATE, ExecutionRegistry
from rq.job import Job
from rq.queue import Queue
from rq.registry import (
    CanceledJobRegistry,
    FailedJobRegistry,
    FinishedJobRegistry,
    StartedJobRegistry,
)
from rq.results import Result
from rq.suspension import WORKERS_SUSPENDED
from rq.worker import Worker

PREFIX = "mlxq"

#: rq's function reference stored in every mlxq job. The worker never imports
#: or calls it: it only checks that a job it dequeued carries this name.
JOB_FUNC = "mlxq.worker.generate"

DEFAULT_REDIS_URL = "redis://localhost:6379/0"
#: How long results are kept (rq's default is 500 s; eval sweeps read them later).
DEFAULT_RESULT_TTL = 24 * 3600
#: How long failure records are kept (rq's default is a year; Redis would only grow).
DEFAULT_FAILURE_TTL = 7 * 24 * 3600
#: The longest any job record is kept, whatever a (rogue) producer asked.
MAX_RECORD_TTL = 30 * 24 * 3600
#: Replay logs outlive their job by this much, so a late listener can still replay.
DEFAULT_STREAM_TTL = 3600

# -- rq's keys -----------------------------------------------------------------------

RQ_JOB = Job.redis_job_namespace_prefix  # rq:job:<id>
RQ_QUEUE = Queue.redis_queue_namespace_prefix  # rq:queue:<name>
RQ_QUEUES = Queue.redis_queues_keys  # set of every queue key
RQ_WORKER = Worker.redis_worker_namespace_prefix  # rq:worker:<name>
RQ_WORKERS = Worker.redis_workers_keys  # set of every worker key
RQ_SUSPENDED = WORKERS_SUSPENDED  # set by ``rq suspend``: workers admit nothing new


def job_key(job_id: str) -> str:
    return f"{RQ_JOB}{job_id}"


def queue_key(queue: str) -> str:
    return f"{RQ_QUEUE}{queue}"


def started_registry(queue: str) -> str:
    """rq's StartedJobRegistry: ``<job id>:<execution id>`` scored by expiry."""
    return str(StartedJobRegistry.key_template.format(queue))


def finished_registry(queue: str) -> str:
    return str(FinishedJobRegistry.key_template.format(queue))


def failed_registry(queue: str) -> str:
    return str(FailedJobRegistry.key_template.format(queue))


def canceled_registry(queue: str) -> str:
    return str(CanceledJobRegistry.key_template.format(queue))


def results_key(job_id: str) -> str:
    """rq's result log of a job (a stream of rq ``Result`` entries)."""
    return str(Result.get_key(job_id))


def execution_key(job_id: str, execution_id: str) -> str:
    return f"{RQ_KEY_PREFIX}:execution:{job_id}:{execution_id}"


def executions_key(job_id: str) -> str:
    return str(ExecutionRegistry.key_template.format(job_id))


def rq_worker_key(worker_name: str) -> str:
    return f"{RQ_WORKER}{worker_name}"


def rq_worker_executions(worker_name: str) -> str:
    return str(WORKER_EXECUTIONS_KEY_TEMPLATE.format(worker_name))


# -- mlxq's keys ---------------------------------------------------------------------

STREAM = f"{PREFIX}:stream:"
CHANNEL = f"{PREFIX}:chan:"
CANCEL_CHANNEL = f"{PREFIX}:cancel:"
WIP = f"{PREFIX}:wip:"
ALIVE = f"{PREFIX}:alive:"
ROLL = f"{PREFIX}:workers:"
REAPED = f"{PREFIX}:reaped:"
WORKER_STATS = f"{PREFIX}:worker:"
ROUTE = f"{PREFIX}:route:"
HANDED = f"{PREFIX}:handed:"
BLOCKER = f"{PREFIX}:blocker:"


def stream_key(job_id: str) -> str:
    """The job's replay log: a Redis stream of chunks, entry id ``0-<seq>``."""
    return f"{STREAM}{job_id}"


def channel(job_id: str) -> str:
    """The job's live pub/sub channel: the same chunks as the stream, as they are made."""
    return f"{CHANNEL}{job_id}"


def worker_stats_key(worker_name: str) -> str:
    """A hash of the worker's counters and model, read by ``mlxq info``."""
    return f"{WORKER_STATS}{worker_name}"


def cancel_channel(worker_name: str) -> str:
    """Where a producer tells the worker holding a job that the job is canceled."""
    return f"{CANCEL_CHANNEL}{worker_name}"


def wip_key(worker_name: str) -> str:
    """Every job a worker holds (buffered or running), moved there atomically from the
    queue; a dead worker's list is how its jobs are found and requeued."""
    return f"{WIP}{worker_name}"


def alive_key(worker_name: str) -> str:
    """A live worker's lease: its token, set with a short expiry by its heartbeat."""
    return f"{ALIVE}{worker_name}"


def lease_held(type_reply: object) -> bool:
    """Whether a worker holds its lease, from the reply to ``TYPE`` of its
    :func:`alive_key`: a string (its token). A key of another type (a rogue write) is
    unreadable, so that worker counts as not live until it rewrites it (within a beat,
    should it live) or a reaper deletes it."""
    return type_reply in (b"string", "string")


def workers_key(queue: str) -> str:
    """Names of the mlxq workers serving ``queue``, dead or alive (the reaper's roll)."""
    return f"{ROLL}{queue}"


def reaped_key(worker_name: str) -> str:
    """Set when a worker was declared dead and its jobs requeued; it tells that worker,
    should it wake, that it owns nothing any more."""
    return f"{REAPED}{worker_name}"


def route_key(queue: str, digest: str) -> str:
    """Which worker last finished the conversation ``digest`` names on ``queue`` (and so
    holds its KV state in its prompt cache): a job continuing it is handed there."""
    return f"{ROUTE}{queue}:{digest}"


def handed_key(worker_name: str) -> str:
    """Jobs handed to a worker by another (a zset of ids by when, in ms): each is also in
    the worker's WIP list, unclaimed, until it claims it or gives it back."""
    return f"{HANDED}{worker_name}"


def blocker_key(worker_name: str) -> str:
    """The client id of the connection a worker blocks on while idle, so a worker handing
    it a job can wake it (``CLIENT UNBLOCK``)."""
    return f"{BLOCKER}{worker_name}"


def lua_header() -> str:
    """The key prefixes as Lua locals, prepended to every script: one source of names."""
    names = {
        "JOB": RQ_JOB,
        "QUEUE": RQ_QUEUE,
        "RESULTS": results_key(""),
        "EXECUTION": f"{RQ_KEY_PREFIX}:execution:",
        "EXECUTIONS": executions_key(""),
        "CANCELED": canceled_registry(""),
        "STARTED": started_registry(""),
        "FINISHED": finished_registry(""),
        "FAILED": failed_registry(""),
        "STREAM": STREAM,
        "CHANNEL": CHANNEL,
        "CANCEL_CHANNEL": CANCEL_CHANNEL,
        "WIP": WIP,
        "ALIVE": ALIVE,
        "ROLL": ROLL,
        "REAPED": REAPED,
    }
    return "".join(f"local K_{k} = '{v}'\n" for k, v in names.items())
