"""The producer side without a worker: imports, payload schema, codec."""

from __future__ import annotations

import contextlib
import inspect
import re
import subprocess
import sys

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlxq.producer.client import Client
from mlxq.producer.codec import Chunk, decode_chunk, encode_chunk
from mlxq.producer.errors import PayloadError
from mlxq.producer.params import (
    SUBMIT_OPTIONS,
    GenerationRequest,
    JobOptions,
    SamplingParams,
    SubmitOptions,
)


def test_producer_imports_no_mlx():
    code = (
        "import sys, mlxq.producer, mlxq.producer.cli; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_submit_imports_neither_the_worker_nor_mlx():
    # The entry loads only the chosen command's module, as mlx-lm's does.
    code = (
        "import contextlib, io, sys\n"
        "from mlxq.producer.cli import main\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['submit', '--help'])\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')\n"
        "       or m == 'mlxq.worker' or m.startswith('mlxq.worker.')]\n"
        "assert not bad, bad\n"
        "assert 'mlxq.producer.commands' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_worker_without_mlx_says_what_to_install():
    # Hide MLX from this interpreter, as on a producer-only install.
    code = (
        "import sys; sys.modules['mlx'] = None; sys.modules['mlx.core'] = None; "
        "sys.modules['mlx_lm'] = None; from mlxq.producer.cli import main; "
        "sys.exit(main(['worker', '--model', 'x']))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "pip install 'mlxq[worker]'" in out.stderr


def test_a_real_import_bug_is_not_reported_as_a_missing_extra():
    # MLX is there; one of mlxq's own modules is broken: say so, not "pip install".
    code = (
        "import sys; sys.modules['mlxq.worker.sink'] = None; "
        "from mlxq.producer.cli import main; sys.exit(main(['worker', '--model', 'x']))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "pip install" not in out.stderr and "mlxq.worker.sink" in out.stderr


def test_worker_help_shows_the_real_defaults_without_mlx():
    from mlxq.worker import config

    code = (
        "import sys; sys.modules['mlx'] = None; sys.modules['mlx_lm'] = None; "
        "import runpy; sys.argv = ['mlxq.worker', '--help']; "
        "runpy.run_module('mlxq.worker', run_name='__main__')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "continuous batches" in text
    for flag, default in (
        ("--window-ms", config.DEFAULT_WINDOW_MS),
        ("--max-batch", config.DEFAULT_MAX_BATCH),
        ("--stream-interval-ms", config.DEFAULT_STREAM_INTERVAL_MS),
        ("--grace-s", config.DEFAULT_GRACE_S),
        ("--slow-turn-ms", config.DEFAULT_SLOW_TURN_MS),
        ("--admit-hold-steps", "auto"),
        ("--prefill-buckets", "auto"),
        ("--fused-prefill", "auto"),
    ):
        env = "MLXQ_" + flag[2:].replace("-", "_").upper()  # each reads its variable first
        assert flag in text and f"(default: ${env}, else {default})" in text, flag


def test_every_submit_option_has_a_type_and_its_docs():
    # A request field declared a submit option fails here until it is typed and documented.
    assert set(JobOptions.__annotations__) == SUBMIT_OPTIONS
    assert set(SubmitOptions.__annotations__) == SUBMIT_OPTIONS - {"prompt"}
    doc = inspect.getdoc(Client.submit) or ""
    args = doc[doc.index("Args:") : doc.index("Returns:")]
    # queue picks where the job goes: an argument of submit's own, not a request field.
    assert set(re.findall(r"^    (\w+):", args, re.M)) == SUBMIT_OPTIONS | {"queue"}


def test_payload_round_trip():
    req = GenerationRequest(
        messages=({"role": "user", "content": "hi"},),
        max_tokens=9,
        sampling=SamplingParams(0.7, 0.9, 40, 0.05, seed=3),
        stop=("\n\n",),
        metadata={"k": [1, 2]},
    )
    wire = msgpack.unpackb(msgpack.packb(req.to_payload()))
    assert GenerationRequest.from_payload(wire) == req


def test_greedy_params_share_one_key_and_seed_never_splits_a_batch():
    assert SamplingParams(0.0, 0.5, 3).key() == SamplingParams().key()
    assert SamplingParams(0.7, seed=1).key() == SamplingParams(0.7, seed=2).key()


json_like = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
fields = st.fixed_dictionaries(
    {"v": st.just(1)},
    optional={
        "prompt": json_like,
        "messages": json_like,
        "max_tokens": json_like,
        "temperature": json_like,
        "top_p": json_like,
        "top_k": json_like,
        "min_p": json_like,
        "seed": json_like,
        "stop": json_like,
        "metadata": json_like,
    },
)


@given(st.one_of(json_like, fields))
def test_payload_decoder_accepts_or_names_the_problem(obj):
    try:
        req = GenerationRequest.from_payload(obj)
    except PayloadError as e:
        assert "=" in str(e) or ":" in str(e)
    else:
        assert GenerationRequest.from_payload(req.to_payload()) == req


@given(st.binary(max_size=64))
def test_chunk_decoder_never_crashes_on_garbage(data):
    with contextlib.suppress(PayloadError):
        decode_chunk(data)


def test_chunk_round_trip():
    c = Chunk(3, "héllo", [1, 2], "length", usage={"prompt_tokens": 1, "completion_tokens": 2})
    assert decode_chunk(encode_chunk(c)) == c
    with pytest.raises(PayloadError, match=r"chunk\.seq=0"):
        decode_chunk(msgpack.packb({"s": 0, "k": "tokens"}))
