"""``mlxq run-batch``: eval sweeps from OpenAI Batch files, resumable, in a bounded window.

- :mod:`~mlxq.producer.batch.lines`: input lines -> requests (through
  :mod:`mlxq.producer.openai_api`, the gateway's mapping) or line errors;
- :mod:`~mlxq.producer.batch.records`: output lines in OpenAI's Batch shape;
- :mod:`~mlxq.producer.batch.files`: the output/errors files and the journal that makes a
  rerun resume;
- :mod:`~mlxq.producer.batch.runner`: the sweep loop (window, submit, poll, collect), with
  :mod:`~mlxq.producer.batch.jobs` (its jobs and their bulk reads) and
  :mod:`~mlxq.producer.batch.stop` (signals, retries through an outage);
- :mod:`~mlxq.producer.batch.run`: one run, start to summary; ``cli``: its arguments.
"""

from mlxq.producer.batch.config import DEFAULT_MAX_IN_FLIGHT, BatchConfig
from mlxq.producer.batch.files import BatchLocked
from mlxq.producer.batch.run import run_batch

__all__ = ["DEFAULT_MAX_IN_FLIGHT", "BatchConfig", "BatchLocked", "run_batch"]
