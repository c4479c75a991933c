"""``mlxq serve``: an OpenAI-compatible HTTP gateway and a live dashboard over mlxq queues.

A producer like any other (it enqueues through :class:`~mlxq.producer.AsyncClient`), so it
imports no MLX. Needs the ``serve`` extra: ``pip install 'mlxq[serve]'``.
"""
