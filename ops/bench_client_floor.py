"""What a burst's first chunk costs the client alone: a server that answers at once.

Why: issue 22 asks the official ``openai`` client's first token, for a burst of 64
streaming chats through ``mlxq serve``, within 50 ms of the Python client's. Part of that
gap is no server's: one ``AsyncOpenAI`` builds, sends and parses its requests one after
another on one event loop. This measures that part. A server of the same stack as ``mlxq
serve`` (uvicorn, in its own process) answers every streaming chat completion with its
first chunk at once, no queue and no model behind it; the burst's first chunks are timed
as ``ops/bench_serve.py`` times them (each request's send to its first chunk with text),
for the openai client with a fresh pool and with its connections opened beforehand, and
for raw HTTP/1.1 written together over sockets opened beforehand.

A first-token gap to the Python client smaller than the openai client's p50 here cannot
be had by any server: what is left of the gap past this floor is the gateway's.

Usage:
    python ops/bench_client_floor.py                  # a burst of 64, 5 rounds
    python ops/bench_client_floor.py --burst 16 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence

from bench_serve import Firsts, http_burst, prompt, serve_burst

WAYS = ("openai", "openai-warm", "http")


def app() -> object:
    """An OpenAI-shaped app that streams each chat completion's first chunk at once."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    count = iter(range(1 << 62))

    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "floor", "object": "model"}]})

    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        cid = f"chatcmpl-{next(count)}"

        def chunk(delta: dict[str, str], finish: str | None) -> str:
            return (
                "data: "
                + json.dumps(
                    {
                        "id": cid,
                        "object": "chat.completion.chunk",
                        "created": int(time.time()),
                        "model": body.get("model", "floor"),
                        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                    }
                )
                + "\n\n"
            )

        async def events() -> AsyncIterator[str]:
            yield chunk({"role": "assistant", "content": "floor"}, None)
            yield chunk({}, "stop")
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(
        routes=[
            Route("/v1/models", models),
            Route("/v1/chat/completions", completions, methods=["POST"]),
        ]
    )


def serve(port: int) -> None:
    import uvicorn

    uvicorn.run(app(), host="127.0.0.1", port=port, log_level="warning", backlog=4096)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_up(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the floor server exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit("the floor server did not start in 30 s")


async def burst(way: str, base: str, texts: list[str]) -> Firsts:
    if way == "http":
        return await http_burst(base, "floor", texts, 1)
    return await serve_burst(base, "floor", texts, 1, warm=way == "openai-warm")


def ms(xs: list[float]) -> tuple[float, float]:
    return statistics.median(xs) * 1000, max(xs) * 1000


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--burst", type=int, default=64, help="requests a burst (default 64)")
    ap.add_argument("--rounds", type=int, default=5, help="bursts each way (default 5)")
    ap.add_argument("--ways", default=",".join(WAYS), help=f"of {','.join(WAYS)}")
    ap.add_argument("--json", help="write each way's rounds here")
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the server's own process
    args = ap.parse_args(argv)
    bad = [w for w in args.ways.split(",") if w not in WAYS]
    if bad:
        ap.error(f"--ways: {','.join(bad)} is not one of {','.join(WAYS)}")
    if args.burst < 1 or args.rounds < 1:
        ap.error(f"--burst {args.burst} --rounds {args.rounds}: each must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve:
        serve(args.serve)
        return 0
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port)])
    try:
        wait_up(port, proc)
        base = f"http://127.0.0.1:{port}"
        texts = [prompt("floor", i) for i in range(args.burst)]
        out: dict[str, list[list[float]]] = {}
        for _ in range(args.rounds):
            for way in args.ways.split(","):
                got = asyncio.run(burst(way, base, texts))
                out.setdefault(way, []).append(got.seconds())
        print(f"first chunk of a burst of {args.burst} from a server that answers at once (ms)")
        print(f"{'way':<12} {'p50 best':>9} {'p50 median':>11} {'max median':>11}")
        for way, rounds in out.items():
            p50s = sorted(ms(x)[0] for x in rounds)
            maxes = sorted(ms(x)[1] for x in rounds)
            print(
                f"{way:<12} {p50s[0]:>9.1f} {statistics.median(p50s):>11.1f} "
                f"{statistics.median(maxes):>11.1f}"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"burst": args.burst, "seconds": out}, f)
    finally:
        proc.terminate()
        proc.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
