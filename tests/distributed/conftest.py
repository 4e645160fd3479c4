"""Helpers for tests that really spawn several gloo processes."""

import os
import socket
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from tests.distributed.training_fixtures import make_assets


@pytest.fixture(scope="session")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Llama with its tokenizer and arithmetic train/val data (``make_assets``), built once; read-only."""
    return make_assets(tmp_path_factory.mktemp("assets"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, fn, args, queue, collective_timeout_s=60):
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    from trainbridge.core.distributed import DistributedEnv

    env = DistributedEnv.initialize("cpu", timeout_s=collective_timeout_s)
    try:
        queue.put((rank, fn(env, *args)))
    except BaseException:
        env.teardown(clean=False)
        raise
    env.teardown()


def run_on_ranks(fn, *args, world_size=2, timeout=120, collective_timeout_s=60):
    """Run ``fn(env, *args)`` on ``world_size`` gloo processes (their group's collectives time out after
    ``collective_timeout_s``); returns results by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue, collective_timeout_s))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            pytest.fail(f"rank process {p.pid} hung for {timeout}s")
        assert p.exitcode == 0, f"a rank exited with {p.exitcode}"
    results = {}
    while not queue.empty():
        rank, value = queue.get()
        results[rank] = value
    return [results[r] for r in range(world_size)]
