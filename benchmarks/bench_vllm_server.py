"""Trainer + `vllm serve` against the in-process vLLM engine and transformers' generate: the same GRPO recipe,
a few updates each, float32 everywhere, each trainer in a process of its own.

Run in the vLLM venv (scripts/vllm_test.sh --setup-only makes it), e.g.

    .venv-vllm/bin/python benchmarks/bench_vllm_server.py --model tiny --updates 3 --rounds 2
    .venv-vllm/bin/python benchmarks/bench_vllm_server.py --model smollm2 --updates 2 \
        --set ppo.ppo_epochs=1 --set generation.max_new_tokens=48

Results and their machine: docs/vllm.md, "Benchmark: server, in-process engine and transformers".

The script starts one server for the model (as docs/vllm.md says: LoRA with runtime updating, float32,
processed log-probs, on CPU --enforce-eager), then runs `ppo train` with generation.backend vllm_server,
vllm and hf in turn (the order flips every round), each for --updates updates. Per update it reports:
wall and the trainer's CPU seconds (time/step_s, time/step_cpu_s), the server's CPU seconds (the server
and its engine process, from /proc, between two updates' metrics lines), the sampling's wall and trainer CPU
seconds (Engine.sample, the adapter hand-over included), rollout/logprob_diff_mean/max, the JSON bytes sent
to and read from the server, and the load average. Per run: the trainer's peak RSS (wait4) and the server's
(VmHWM of each of its processes). Models: ``tiny`` is the tiny test policy with 32-dim heads
(tests/fixtures/vllm_models.py; vLLM's CPU attention refuses 24) and recipes/tiny_grpo.yaml; ``smollm2`` is
SmolLM2-135M-Instruct from .cache/smollm2-0.1.2 and recipes/smollm2_concise_grpo.yaml.

``--trainer ARGS...`` is the script's other half: `ppo ARGS...` with Engine.sample and the server's requests
timed and counted into each update's metrics (bench/*), run by the first half in a subprocess.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.fixtures.vllm_server import start_server, stop_server  # noqa: E402 - after the path
CLK_TCK = os.sysconf("SC_CLK_TCK")
BACKENDS = ("vllm_server", "vllm", "hf")
SERVED_NAME = "bench-base"


# --- the trainer's half: `ppo train` with the sampling timed ---------------------------------------------


def instrumented_ppo(argv: list[str]) -> None:
    """`ppo argv` with bench/sampling_s, bench/sampling_cpu_s, bench/bytes_sent, bench/bytes_received and
    bench/requests added to each update's metrics (the rollout's Engine.sample calls, and the JSON bodies
    of the requests to the server; HTTP headers not counted)."""
    from ppo_cli import trainer
    from ppo_cli.cli import main
    from ppo_cli.engine import vllm_server_sampler
    from ppo_cli.engine.engine import Engine

    spent = {"sampling_s": 0.0, "sampling_cpu_s": 0.0, "bytes_sent": 0, "bytes_received": 0, "requests": 0}
    sample, train_step, request_json = Engine.sample, trainer.train_step, vllm_server_sampler.request_json

    def timed_sample(self, *args, **kwargs):
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return sample(self, *args, **kwargs)
        finally:
            spent["sampling_s"] += time.perf_counter() - wall
            spent["sampling_cpu_s"] += time.process_time() - cpu

    async def counted_request(*args, body=None, **kwargs):
        answer = await request_json(*args, body=body, **kwargs)
        spent["requests"] += 1
        spent["bytes_sent"] += len(json.dumps(body, separators=(",", ":"))) if body is not None else 0
        spent["bytes_received"] += len(answer) if isinstance(answer, str) else len(json.dumps(answer, separators=(",", ":")))
        return answer

    def timed_step(state):
        for key in spent:
            spent[key] = 0
        metrics, rollout = train_step(state)
        metrics.update({f"bench/{key}": value for key, value in spent.items()})
        return metrics, rollout

    Engine.sample, trainer.train_step, vllm_server_sampler.request_json = timed_sample, timed_step, counted_request
    main(argv)


# --- /proc ---------------------------------------------------------------------------------------------------


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    return tree


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` so far."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
    return total / CLK_TCK


def status_gb(pid: int, key: str) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1e6
    except OSError:
        pass
    return 0.0


def load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


# --- the models and the recipe ---------------------------------------------------------------------------------


def model_setup(name: str, cache: Path) -> tuple[Path, list[str], int]:
    """The policy directory the server and trainers load, the recipe + overrides, and the server's max model length."""
    if name == "tiny":
        from tests.fixtures.model_cache import tiny_models_dir
        from tests.fixtures.vllm_models import widen_heads

        tiny = tiny_models_dir()
        if not (tiny / "policy" / "config.json").exists():
            sys.exit(f"no tiny models at {tiny}: run scripts/test.sh once (it builds them)")
        policy = cache / f"wide-{tiny.name}" / "policy"
        if not (policy / "config.json").exists():
            widen_heads(tiny / "policy", policy)
        reward = ("[{type: classifier, path: '%s', labels: {negative: -1.0, neutral: 0.1, positive: 10.0}, "
                  "scale_by_confidence: true, text: response}, {type: function, function: '%s'}]"
                  % (tiny / "reward", ROOT / "recipes/rewards/min_length.py:too_short"))
        return policy, [str(ROOT / "recipes/tiny_grpo.yaml"), "--set", f"reward.components={reward}",
                        "--set", f"data.prompts={ROOT / 'recipes/prompts/reviews.txt'}"], 64
    policy = ROOT / ".cache" / "smollm2-0.1.2"
    if not (policy / "config.json").exists():
        sys.exit(f"no SmolLM2 at {policy}: python scripts/fetch_smollm2.py writes it")
    reward = "[{type: function, function: '%s'}]" % (ROOT / "recipes/rewards/concise.py:concise")
    return policy, [str(ROOT / "recipes/smollm2_concise_grpo.yaml"), "--set", f"reward.components={reward}",
                    "--set", f"data.prompts={ROOT / 'recipes/prompts/chat_questions.jsonl'}"], 64 + 96


# --- the server --------------------------------------------------------------------------------------------------


def serve(policy: Path, max_model_len: int, log: Path) -> tuple[subprocess.Popen, str]:
    """The server as the vLLM tests start it (tests/fixtures/vllm_server.py), once it answers."""
    proc, url = start_server(policy, SERVED_NAME, max_model_len, log)
    started = time.monotonic()
    while True:
        if proc.poll() is not None:
            sys.exit(f"the server exited ({proc.returncode}); its log: {log}")
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=5).read()
            break
        except OSError:
            if time.monotonic() - started > 900:
                stop_server(proc)
                sys.exit(f"the server did not answer within 900 s; its log: {log}")
            time.sleep(1)
    print(f"server up in {time.monotonic() - started:.0f} s: {' '.join(proc.args)}", flush=True)
    return proc, url


# --- one run -----------------------------------------------------------------------------------------------------


def run_trainer(backend: str, recipe_args: list[str], policy: Path, updates: int, out: Path, server, url: str) -> dict:
    """One `ppo train` of ``updates`` updates with ``backend``, watched from outside: per update its metrics
    and the server's CPU seconds since the previous update; per run the trainer's CPU and peak RSS."""
    run_dir = out / backend
    out.mkdir(parents=True, exist_ok=True)
    sets = {"policy.path": policy, "output_dir": run_dir, "name": "bench", "train.total_updates": updates,
            "train.save_every": updates, "train.sample_every": 1000, "train.mixed_precision": "no",
            "policy.dtype": "float32", "data.eval_prompts": "null", "generation.backend": backend}
    if backend == "vllm_server":
        sets["generation.server_url"] = url
    cmd = [sys.executable, __file__, "--trainer", "train", *recipe_args]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(ROOT)}
    server_pids = process_tree(server.pid)
    metrics_file = run_dir / "bench" / "metrics.jsonl"
    log = out / f"{backend}.log"
    started, loads = time.perf_counter(), []
    server_cpu = [cpu_seconds(server_pids)]
    seen = 0
    with open(log, "w") as stream:
        proc = subprocess.Popen(cmd, env=env, stdout=stream, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            lines = metrics_file.read_text().splitlines() if metrics_file.exists() else []
            if len(lines) > seen:  # an update ended: the server's CPU since the previous one
                server_cpu += [cpu_seconds(server_pids)] * (len(lines) - seen)
                loads.append(load_average())
                seen = len(lines)
            if pid:
                break
            time.sleep(0.2)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    wall = time.perf_counter() - started
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        sys.exit(f"{backend}: ppo train exited {code}; its log: {log}\n" + log.read_text()[-3000:])
    metrics = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    adapter = run_dir / "bench" / "final" / "adapter_model.safetensors"
    return {"backend": backend, "wall_s": wall, "trainer_cpu_s": usage.ru_utime + usage.ru_stime,
            "trainer_peak_gb": usage.ru_maxrss / 1e6, "adapter_mb": adapter.stat().st_size / 1e6,
            "server_cpu_per_update": [b - a for a, b in zip(server_cpu, server_cpu[1:])], "load": loads,
            "metrics": metrics}


# --- the report --------------------------------------------------------------------------------------------------


def table(results: list[dict], server_peak_gb: float) -> str:
    head = ("| round | backend | update | wall s | trainer CPU s | server CPU s | sampling s (trainer CPU s) | "
            "response tokens (mean) | logprob diff mean / max | sent / read KB | load |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        for i, m in enumerate(r["metrics"]):
            server = r["server_cpu_per_update"][i] if r["backend"] == "vllm_server" else float("nan")
            diff = (f"{m['rollout/logprob_diff_mean']:.1e} / {m['rollout/logprob_diff_max']:.1e}"
                    if "rollout/logprob_diff_mean" in m else "-")
            wire = (f"{m['bench/bytes_sent'] / 1e3:.1f} / {m['bench/bytes_received'] / 1e3:.1f}"
                    if m["bench/requests"] else "-")
            rows.append(f"| {r['round']} | {r['backend']} | {m['step']} | {m['time/step_s']:.1f} | "
                        f"{m['time/step_cpu_s']:.1f} | {server:.1f} | {m['bench/sampling_s']:.1f} "
                        f"({m['bench/sampling_cpu_s']:.1f}) | {m['response_length']:.1f} | "
                        f"{diff} | {wire} | {r['load'][i] if i < len(r['load']) else float('nan'):.1f} |")
    rows.append("")
    rows.append("| round | backend | run wall s | trainer CPU s (whole process) | trainer peak RSS GB | "
                "median of updates 2.. wall / trainer CPU / + server CPU s |")
    rows.append("|---|---|---|---|---|---|")
    for r in results:
        later = r["metrics"][1:] or r["metrics"]
        server = r["server_cpu_per_update"][1:] or r["server_cpu_per_update"]
        wall = statistics.median(m["time/step_s"] for m in later)
        cpu = statistics.median(m["time/step_cpu_s"] for m in later)
        both = (statistics.median(m["time/step_cpu_s"] + s for m, s in zip(later, server))
                if r["backend"] == "vllm_server" else cpu)
        rows.append(f"| {r['round']} | {r['backend']} | {r['wall_s']:.0f} | {r['trainer_cpu_s']:.0f} | "
                    f"{r['trainer_peak_gb']:.2f} | {wall:.2f} / {cpu:.2f} / {both:.2f} |")
    rows.append(f"\nserver peak RSS (VmHWM, its processes summed): {server_peak_gb:.2f} GB")
    return "\n".join(rows)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--trainer":
        return instrumented_ppo(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="one more recipe override for every run (e.g. ppo.ppo_epochs=1), repeatable")
    ap.add_argument("--out", type=Path, help="results JSON (default: under the work directory)")
    args = ap.parse_args()
    from ppo_cli.engine.precision_probe import machine_record

    print(f"machine: {machine_record()}", flush=True)
    work = Path(tempfile.mkdtemp(prefix=f"ppo_cli-bench-server-{args.model}-"))
    cache = Path(tempfile.gettempdir()) / "ppo_cli-bench-vllm-models"
    policy, recipe_args, max_len = model_setup(args.model, cache)
    for item in args.set:
        recipe_args += ["--set", item]
    # a SIGTERM to this script goes through the finally below: the server is stopped, not left running
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("stopped by SIGTERM"))
    server, url = serve(policy, max_len, work / "server.log")
    server_pids = process_tree(server.pid)
    idle = cpu_seconds(server_pids)
    time.sleep(10)
    print(f"server idle: {cpu_seconds(server_pids) - idle:.2f} CPU s in 10 s; "
          f"processes {server_pids}; load {load_average():.1f}", flush=True)
    results = []
    backends = args.backends.split(",")
    try:
        for round_ in range(1, args.rounds + 1):
            order = backends if round_ % 2 else backends[::-1]
            for backend in order:
                result = run_trainer(backend, recipe_args, policy, args.updates, work / f"round{round_}", server, url)
                result["round"] = round_
                results.append(result)
                m = result["metrics"]
                print(f"round {round_} {backend}: {[round(x['time/step_s'], 1) for x in m]} s per update, "
                      f"trainer CPU {[round(x['time/step_cpu_s'], 1) for x in m]}, server CPU "
                      f"{[round(x, 1) for x in result['server_cpu_per_update']]}, peak {result['trainer_peak_gb']:.2f} GB",
                      flush=True)
        server_peaks = {f"{pid} {Path(f'/proc/{pid}/comm').read_text().strip()}": status_gb(pid, "VmHWM")
                        for pid in process_tree(server.pid)}
        server_peak = sum(server_peaks.values())
        print(f"server processes' peak RSS (VmHWM) GB: {server_peaks}", flush=True)
    finally:
        stop_server(server)
    out = args.out or work / "results.json"
    out.write_text(json.dumps({"machine": machine_record(), "model": args.model, "policy": str(policy),
                               "server_peak_gb": server_peak, "server_peaks_gb": server_peaks, "results": results}, indent=1))
    print(table(results, server_peak))
    print(f"results: {out}; logs under {work}")


if __name__ == "__main__":
    main()
