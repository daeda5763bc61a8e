"""Training rates from MLPerf Training's public DLRM-DCNv2 result logs (the data `bench_mlperf.py` validates on).

A result log (`<org>/results/<system>/dlrm_dcnv2/result_N.txt`) is a stream of `:::MLLOG {json}` lines.
The training rate is read between evaluations: the samples of one eval_stop -> next eval_start span
(its epoch_num difference x `train_samples`) over its wall time, median over the run's spans. The log's
own `tracked_stats.throughput` counts the evaluations too, so it is kept only for reference. GPU count
and accelerator come from `<org>/systems/<system>.json`. Every result file of a system is read
(MLPerf asks for 10 runs): the median of their rates, with min and max.

Time to train, as MLPerf scores it: run_start -> run_stop of each run (median over the system's
converged runs), with the samples trained by then (run_stop's epoch_num x `train_samples`) and the
evaluations' own seconds inside it (eval_start -> eval_stop, summed). `rate_peak` is the fastest
span of any run: a system whose runs slow down after their first minutes shows it above `rate`.
`logged`: what HugeCTR printed of every run, where the runs agree (`logged`): the devices by their CUDA
name, which is what ran where it differs from the system description's accelerator.

`same_server`: the round's other benchmarks (ResNet, BERT, ...) run on the same server as a
DLRM-DCNv2 system (`server`: its org and its description's name, accelerator, nodes, GPUs per node
and CPU), each as the median over its runs of the run's median `tracked_stats.throughput`: the
server's speed on workloads without DLRM's all-to-all, to tell its device apart from its links
(`bench_mlperf.py`).

    git clone --bare https://github.com/mlcommons/training_results_v4.0 training_results_v4.0   # each round
    .venv/bin/python benchmarks/mlperf_logs.py training_results_v3.0 training_results_v3.1 ...

reads the snapshots as git directories (bare clones do; no work tree needed) and writes
benchmarks/data/mlperf_dlrm_dcnv2.json.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "data" / "mlperf_dlrm_dcnv2.json"
RESULT = re.compile(r"^(?P<org>[^/]+)/results/(?P<system>[^/]+)/dlrm_dcnv2/result_\d+\.txt$")
ANY_RESULT = re.compile(r"^(?P<org>[^/]+)/results/(?P<system>[^/]+)/(?P<bench>\w+)/"
                        r"result_\d+\.txt$")
# What makes two system descriptions one server: the fields that name its hardware (the framework
# differs)
SERVER = ("system_name", "accelerator_model_name", "number_of_nodes", "accelerators_per_node",
          "host_processor_model_name")
# What HugeCTR prints of the run itself, beside the MLLOG stream: the CUDA name of each device it ran on (which
# may differ from the system description's accelerator), the NUMA node of each GPU, its version, and its
# planner's embedding placement (model-parallel and data-parallel tables).
DEVICE = re.compile(r"\]: Device (\d+): (.+?)\s*$")
NUMA = re.compile(r"^(?:\[HCTR\].*\]:)?\s+GPU (\d+) ->\s+node (\d+)")
HUGECTR = re.compile(r"^HugeCTR Version: (\S+)")
PLACEMENT = re.compile(r"^\[\('mp', \[([\d, ]*)\]\), \('dp', \[([\d, ]*)\]\)\]")


def logged(text: str) -> dict:
    """What one run's log says it ran on, where HugeCTR printed it: `devices` (the CUDA names, distinct),
    `numa` (each GPU's NUMA node, by GPU), `hugectr` (its version), `dp_tables` (tables its planner kept
    data-parallel). Keys it did not print are absent."""
    devices: dict[int, str] = {}
    numa: dict[int, int] = {}
    out: dict = {}
    for line in text.splitlines():
        if m := DEVICE.search(line):
            devices.setdefault(int(m[1]), m[2])
        elif m := NUMA.search(line):
            numa.setdefault(int(m[1]), int(m[2]))
        elif m := HUGECTR.match(line):
            out.setdefault("hugectr", m[1])
        elif m := PLACEMENT.match(line):
            out.setdefault("dp_tables", len([x for x in m[2].split(",") if x.strip()]))
    if devices:
        out["devices"] = sorted(set(devices.values()))
    if numa:
        out["numa"] = [numa[g] for g in sorted(numa)]
    return out


def parse_log(text: str) -> dict:
    """One run: global batch, training samples/s between evaluations (median over the spans), the spans'
    count and the last tracked throughput. Raises ValueError when the log has no complete span."""
    gb = samples = tracked = None
    events: list[tuple[str, int, float]] = []
    run: dict[str, dict] = {}
    for line in text.splitlines():
        if ":::MLLOG" not in line:
            continue
        d = json.loads(line.split(":::MLLOG", 1)[1])
        key = d["key"]
        if key == "global_batch_size":
            gb = d["value"]
        elif key == "train_samples":
            samples = d["value"]
        elif key == "tracked_stats":
            tracked = d["value"].get("throughput")
        elif key in ("eval_start", "eval_stop"):
            events.append((key, d["time_ms"], d["metadata"]["epoch_num"]))
        elif key in ("run_start", "run_stop"):
            run[key] = {"t": d["time_ms"], **d.get("metadata", {})}
    rates, stop, start, eval_ms = [], None, None, 0.0
    for key, t, epoch in events:
        if key == "eval_stop":
            stop = (t, epoch)
            eval_ms += t - start if start is not None else 0.0
        elif stop is not None and t > stop[0]:
            rates.append((epoch - stop[1]) * samples / ((t - stop[0]) / 1e3))
            stop = None
        if key == "eval_start":
            start = t
    if not rates or gb is None:
        raise ValueError("no training span between two evaluations")
    out = {"global_batch": gb, "rate": statistics.median(rates), "rate_peak": max(rates),
           "spans": len(rates), "tracked": tracked, "eval_s": eval_ms / 1e3,
           "evals": sum(k == "eval_stop" for k, _, _ in events)}
    if "run_start" in run and "run_stop" in run:  # time to train, as MLPerf scores it
        end = run["run_stop"]
        out.update(converged=end.get("status") == "success",
                   ttt_s=(end["t"] - run["run_start"]["t"]) / 1e3, epochs=end.get("epoch_num"),
                   samples=end["epoch_num"] * samples if end.get("epoch_num") is not None else None)
    return out


def time_to_train(runs: list[dict]) -> dict:
    """A system's converged runs: median run_start -> run_stop seconds (with min and max), median
    samples and epochs at run_stop, median seconds of evaluation and evaluations per run; {} if none
    converged."""
    if not runs:
        return {}

    def med(k: str) -> float:
        return statistics.median(r[k] for r in runs)

    return {"converged_runs": len(runs), "ttt_s": med("ttt_s"),
            "ttt_s_min": min(r["ttt_s"] for r in runs), "ttt_s_max": max(r["ttt_s"] for r in runs),
            "samples_to_target": med("samples"),
            "epochs_to_target": med("epochs"), "eval_s": med("eval_s"), "evals": med("evals")}


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                          errors="replace", check=True).stdout


def _shown(repo: Path, path: str) -> str:
    """A file of the snapshot's HEAD; "" where the snapshot lists it but does not hold it (a large
    file)."""
    try:
        return _git(repo, "show", f"HEAD:{path}")
    except subprocess.CalledProcessError:
        return ""


def tracked_rate(text: str) -> float | None:
    """A run's median `tracked_stats.throughput` (its implementation's own samples/s; None if it
    logs none)."""
    vals = []
    for line in text.splitlines():
        if ":::MLLOG" in line and '"tracked_stats"' in line:
            try:
                d = json.loads(line.split(":::MLLOG", 1)[1])
            except ValueError:
                continue  # a line cut short (a run killed mid-write)
            if isinstance(d.get("value"), dict) and d["value"].get("throughput"):
                vals.append(float(d["value"]["throughput"]))
    return statistics.median(vals) if vals else None


def server(org: str, desc: dict) -> tuple[str, ...]:
    """The server a system ran on: its org and its description's `SERVER` fields."""
    return (org, *(str(desc.get(k, "")).strip() for k in SERVER))


def _described(repo: Path, org: str, system: str) -> dict | None:
    """A system's description (`<org>/systems/<system>.json`), None where it cannot be read."""
    try:
        return json.loads(_git(repo, "show", f"HEAD:{org}/systems/{system}.json"))
    except (subprocess.CalledProcessError, ValueError):
        return None


def same_server(repo: Path, files: list[str], dlrm: dict[str, tuple[str, ...]]) -> dict[str, dict]:
    """{DLRM system: {benchmark: {system, runs, rate, rate_min, rate_max}}}: the round's other
    benchmarks on each DLRM system's server (`dlrm`: system -> `server`), the same-named directory
    first where the server has several."""
    runs: dict[tuple[str, str, str], list[str]] = {}
    for f in files:
        if (m := ANY_RESULT.match(f)) and m["bench"] != "dlrm_dcnv2":
            runs.setdefault((m["org"], m["system"], m["bench"]), []).append(f)
    by_server: dict[tuple, list[tuple[str, str]]] = {}
    for org, system in sorted({(org, system) for org, system, _ in runs}):
        if org in {key[0] for key in dlrm.values()} and (desc := _described(repo, org, system)):
            if (key := server(org, desc)) in dlrm.values():
                by_server.setdefault(key, []).append((org, system))
    out: dict[str, dict] = {}
    for dlrm_system, key in dlrm.items():
        mine = sorted(by_server.get(key, []), key=lambda d: d[1] != dlrm_system)
        for bench in sorted({b for o, s, b in runs if (o, s) in mine}):
            o, s = next(d for d in mine if (*d, bench) in runs)
            rates = [r for f in runs[(o, s, bench)] if (r := tracked_rate(_shown(repo, f)))]
            if rates:
                out.setdefault(dlrm_system, {})[bench] = {
                    "system": s, "runs": len(rates), "rate": statistics.median(rates),
                    "rate_min": min(rates), "rate_max": max(rates)}
    return out


def read_round(repo: Path) -> dict:
    """Every DLRM-DCNv2 system of one round's snapshot: {system: {org, gpus, accelerator, ..., rate}}."""
    files = _git(repo, "ls-tree", "-r", "--name-only", "HEAD").split("\n")
    runs: dict[tuple[str, str], list[dict]] = {}
    for f in files:
        m = RESULT.match(f)
        if m:
            text = _shown(repo, f)
            try:
                run = parse_log(text) | {"logged": logged(text)}
            except ValueError:
                continue  # an incomplete log, or one the snapshot lists but does not hold ("")
            runs.setdefault((m["org"], m["system"]), []).append(run)
    out, servers = {}, {}
    for (org, system), rs in sorted(runs.items()):
        try:
            desc = _described(repo, org, system) or {}
            gpus = int(desc["number_of_nodes"]) * int(desc["accelerators_per_node"])
        except (KeyError, ValueError):
            continue  # a system without a readable description: its GPU count is unknown
        rates = [r["rate"] for r in rs]
        out[system] = {"org": org, "gpus": gpus, "nodes": int(desc["number_of_nodes"]),
                       "accelerator": desc.get("accelerator_model_name", ""), "global_batch": rs[0]["global_batch"],
                       "runs": len(rs), "rate": statistics.median(rates), "rate_min": min(rates),
                       "rate_max": max(rates), "rate_peak": max(r["rate_peak"] for r in rs),
                       "tracked": statistics.median(r["tracked"] or 0.0 for r in rs),
                       **time_to_train([r for r in rs if r.get("converged")]),
                       **({"logged": seen} if (seen := as_logged(rs)) else {})}
        servers[system] = server(org, desc)
    for system, benches in same_server(repo, files, servers).items():
        out[system]["same_server"] = benches
    return out


def as_logged(runs: list[dict]) -> dict:
    """A system's `logged` facts: each one its runs agree on (a fact they disagree on is left out)."""
    keys = {k for r in runs for k in r["logged"]}
    return {k: vals[0] for k in sorted(keys)
            if len(vals := [r["logged"][k] for r in runs if k in r["logged"]]) == len(runs)
            and all(v == vals[0] for v in vals)}


def _fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def main(repos: list[str]) -> None:
    if not repos:
        _fail("give the training_results_vX.Y snapshots to read (git directories)")
    data = {}
    for r in repos:
        repo = Path(r)
        name = re.search(r"training_results_(v[\d.]+)", str(repo))
        if not name:
            _fail(f"{repo}: not a training_results_vX.Y snapshot")
        try:
            head = _git(repo, "rev-parse", "HEAD")[:7]
        except (subprocess.CalledProcessError, FileNotFoundError):
            _fail(f"{repo}: not a git directory")
        data[name[1]] = {"source": f"mlcommons/training_results_{name[1]}@{head}", "systems": read_round(repo)}
        print(f"{name[1]}: {len(data[name[1]]['systems'])} systems")
    OUT.write_text(json.dumps(data, indent=1, sort_keys=True))


if __name__ == "__main__":
    main(sys.argv[1:])
