"""Added latency of Reef and LiteLLM over a loopback stub at one client, then throughput and peak RSS.

Method (after cuihuan/llm-gateway-bench): interleaved rounds. Each round sends ``--per-round`` sequential
requests to each target (stub direct, Reef, LiteLLM) over a kept-alive connection, in an order that rotates from
round to round, so drift in the machine's load hits every target alike. Added latency at a percentile is the
proxied percentile minus the direct one; the median of per-round median differences is reported as well.
The plain client (``http.client``, one kept-alive connection) is the floor; ``stub-sdk``/``reef-sdk`` are the same
calls through the ``openai`` SDK (what a user's code runs: httpx, keep-alive, its own headers), compared with each
other (``--no-sdk`` skips them).

Reef runs with the upstream engine and its default durable store: SQLite in WAL mode with ``synchronous=FULL``,
so every reply waited for its record's fsync. LiteLLM runs with default settings and no database.
"""

from __future__ import annotations

import http.client
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

from bench import common, throughput


def add_arguments(parser) -> None:
    parser.add_argument("--rounds", type=int, default=40, help="interleaved rounds (default 40)")
    parser.add_argument("--per-round", type=int, default=25, help="requests per target per round (default 25)")
    parser.add_argument("--warmup", type=int, default=50, help="unmeasured requests per target first")
    parser.add_argument("--duration", type=float, default=6.0, help="seconds per wrk run (default 6)")
    parser.add_argument("--connections", default="1,16,64", help="wrk concurrencies (default 1,16,64)")
    parser.add_argument("--no-throughput", action="store_true", help="latency only")
    throughput.add_workers_argument(parser)
    parser.add_argument("--no-litellm", action="store_true", help="skip the LiteLLM proxy")
    parser.add_argument("--no-sdk", action="store_true",
                        help="skip the openai SDK client rows (stub-sdk, reef-sdk)")
    parser.add_argument("--scoped-tokens", type=int, default=0, metavar="N",
                        help="also measure a second Reef ('reef-scoped') with N scoped tokens (rate limits on), "
                             "called with the last of them, interleaved with the plain one")
    parser.add_argument("--tracing", action="store_true",
                        help="also measure a Reef ('reef-tracing') exporting OTLP to a collector that is down "
                             "(observability.tracing on, nothing listening), interleaved with the plain one")


class Client:
    """One kept-alive HTTP/1.1 connection, the cheapest and steadiest client the stdlib offers."""

    def __init__(self, url: str, token: str = common.TOKEN):
        parts = urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
        self.headers = {"content-type": "application/json", "authorization": f"Bearer {token}",
                        "x-reef-scenario": "bench-latency"}
        self.body = common.chat_body()

    def call(self) -> tuple[float, dict]:
        started = time.perf_counter()
        self.conn.request("POST", "/v1/chat/completions", body=self.body, headers=self.headers)
        resp = self.conn.getresponse()
        data = resp.read()
        elapsed = (time.perf_counter() - started) * 1000
        if resp.status != 200:
            raise RuntimeError(f"{resp.status}: {data[:300]!r}")
        return elapsed, {k.lower(): v for k, v in resp.getheaders()}

    def close(self) -> None:
        self.conn.close()


class SdkClient:
    """The same call through the ``openai`` SDK (httpx, one kept-alive connection, the SDK's own headers)."""

    def __init__(self, url: str, token: str = common.TOKEN):
        import json

        import openai

        self.client = openai.OpenAI(base_url=url + "/v1", api_key=token, max_retries=0, timeout=30,
                                    default_headers={"x-reef-scenario": "bench-latency-sdk"})
        self.body = json.loads(common.chat_body())

    def call(self) -> tuple[float, dict]:
        started = time.perf_counter()
        raw = self.client.chat.completions.with_raw_response.create(**self.body)
        raw.parse()
        elapsed = (time.perf_counter() - started) * 1000
        return elapsed, {k.lower(): v for k, v in raw.headers.items()}

    def close(self) -> None:
        self.client.close()


def latency(targets: dict[str, common.Child], rounds: int, per_round: int, warmup: int,
            tokens: dict[str, str] | None = None, sdk: bool = False) -> dict:
    clients = {name: Client(child.url, (tokens or {}).get(name, common.TOKEN)) for name, child in targets.items()}
    served_by = {name: name for name in targets}  # client row -> the target (process) it calls
    if sdk:
        for name in ("stub", "reef"):
            clients[f"{name}-sdk"] = SdkClient(targets[name].url)
            served_by[f"{name}-sdk"] = name
    samples: dict[str, list[float]] = {name: [] for name in clients}
    round_medians: dict[str, list[float]] = {name: [] for name in clients}
    overhead_header: list[float] = []
    receipts = 0
    try:
        for client in clients.values():
            for _ in range(warmup):
                client.call()
        names = list(clients)
        cpu_before = {name: child.cpu_seconds() for name, child in targets.items()}
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                times = []
                for _ in range(per_round):
                    ms, headers = clients[name].call()
                    times.append(ms)
                    if name.startswith("reef"):
                        receipts += "x-reef-agent-record-id" in headers
                    if name.startswith("reef") and not name.endswith("-sdk"):
                        overhead_header.append(float(headers.get("x-reef-overhead-ms", "nan")))
                samples[name].extend(times)
                round_medians[name].append(statistics.median(times))
        # Per request the process served, whichever client sent it (the SDK rows share their target's figure).
        cpu_ms = {name: round((targets[served_by[name]].cpu_seconds() - cpu_before[served_by[name]]) * 1000
                              / sum(len(samples[n]) for n in clients if served_by[n] == served_by[name]), 3)
                  for name in clients}
    finally:
        for client in clients.values():
            client.close()
    stats = {name: common.percentiles(values) for name, values in samples.items()}
    added = {}
    for name in clients:
        if served_by[name] == "stub":
            continue
        base = "stub-sdk" if name.endswith("-sdk") else "stub"  # each client against the stub through itself
        added[name] = {p: round(stats[name][p] - stats[base][p], 3) for p in ("p50", "p95", "p99")}
        added[name]["median_of_round_medians"] = round(statistics.median(
            a - b for a, b in zip(round_medians[name], round_medians[base])), 3)
    # The stub's own CPU includes the requests the proxies forwarded to it: the sum is what one call costs.
    result = {"rounds": rounds, "per_round": per_round, "latency_ms": stats, "added_ms": added,
              "server_cpu_ms_per_request": cpu_ms}
    if "reef" in targets:
        result["reef_receipts"] = receipts
        result["reef_requests"] = sum(len(samples[n]) for n in clients if n.startswith("reef"))
        result["reef_overhead_header_ms"] = common.percentiles(overhead_header)
    if "reef" in added and "reef-scoped" in added:
        result["ratio_scoped_over_plain"] = {
            p: round(added["reef-scoped"][p] / added["reef"][p], 3) if added["reef"][p] > 0 else None
            for p in ("p50", "p95", "p99", "median_of_round_medians")}
    if "reef" in added and "reef-tracing" in added:
        result["ratio_tracing_over_plain"] = {
            p: round(added["reef-tracing"][p] / added["reef"][p], 3) if added["reef"][p] > 0 else None
            for p in ("p50", "p95", "p99", "median_of_round_medians")}
    if "reef" in added and "litellm" in added:
        result["ratio_reef_over_litellm"] = {
            p: round(added["reef"][p] / added["litellm"][p], 3) if added["litellm"][p] > 0 else None
            for p in ("p50", "p95", "p99")}
    return result


def run(args) -> dict:
    machine = common.machine()  # the load average before we add ours
    workdir = Path(tempfile.mkdtemp(prefix="reef-bench-"))
    children: list[common.Child] = []
    began = time.monotonic()
    try:
        started, targets = common.start_systems(workdir, not args.no_litellm)
        children.extend(started)
        tokens = {}
        if args.scoped_tokens > 0:
            scoped = common.start_reef(targets["stub"].url, workdir / "data-scoped",
                                       common.scoped_tokens_override(args.scoped_tokens), name="reef-scoped")
            children.append(scoped)
            targets["reef-scoped"] = scoped
            tokens["reef-scoped"] = common.scoped_token(args.scoped_tokens - 1)
        if args.tracing:  # the acceptance of #40: a dead collector adds under 5% at p50
            dead = f"http://127.0.0.1:{common.free_port()}/v1/traces"
            tracing = common.start_reef(targets["stub"].url, workdir / "data-tracing",
                                        "observability.tracing.enabled=true",
                                        f"observability.tracing.endpoint={dead}", name="reef-tracing")
            children.append(tracing)
            targets["reef-tracing"] = tracing
        lat = latency(targets, args.rounds, args.per_round, args.warmup, tokens, sdk=not args.no_sdk)
        rss_after_latency = {c.name: c.peak_rss_mib() for c in children}
        runs: list[dict] = []
        if not args.no_throughput:
            connections = [int(c) for c in str(args.connections).split(",")]
            data_dirs = {"reef": workdir / "data"}
            extra = throughput.start_workers_target(targets, data_dirs, workdir, args.workers)
            if extra is not None:
                children.append(extra)
            runs = throughput.measure(targets, data_dirs, connections, args.duration)
        rss = {c.name: c.peak_rss_mib() for c in children}
    finally:
        for child in reversed(children):
            child.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    rows = [[name, s["p50"], s["p95"], s["p99"], s["mean"],
             *(lat["added_ms"].get(name, {}).get(p) for p in ("p50", "p95", "p99", "median_of_round_medians")),
             lat["server_cpu_ms_per_request"][name]]
            for name, s in lat["latency_ms"].items()]
    print(f"Latency at one client ({lat['rounds']} interleaved rounds x {lat['per_round']} requests), ms")
    print(common.table(["target", "p50", "p95", "p99", "mean", "added p50", "added p95", "added p99",
                        "added (round medians)", "cpu ms/req"], rows))
    if "ratio_reef_over_litellm" in lat:
        ratio = lat["ratio_reef_over_litellm"]
        print(f"Reef/LiteLLM added latency: p50 x{ratio['p50']}, p95 x{ratio['p95']}, p99 x{ratio['p99']}")
    if "ratio_scoped_over_plain" in lat:
        ratio = lat["ratio_scoped_over_plain"]
        print(f"Reef with {args.scoped_tokens} scoped tokens / without, added latency: p50 x{ratio['p50']}, "
              f"p95 x{ratio['p95']}, p99 x{ratio['p99']}, round medians x{ratio['median_of_round_medians']}")
    if "ratio_tracing_over_plain" in lat:
        ratio = lat["ratio_tracing_over_plain"]
        print(f"Reef tracing to a dead collector / tracing off, added latency: p50 x{ratio['p50']}, "
              f"p95 x{ratio['p95']}, p99 x{ratio['p99']}, round medians x{ratio['median_of_round_medians']}")
    if "reef" in lat["added_ms"]:
        print(f"Reef receipts: {lat['reef_receipts']} of {lat['reef_requests']} responses; "
              f"x-reef-overhead-ms p50 {lat['reef_overhead_header_ms']['p50']} "
              f"p99 {lat['reef_overhead_header_ms']['p99']}")
    problems = []
    if runs:
        print()
        print(f"Throughput (wrk, {args.duration:g} s per run)")
        print(common.table(throughput.HEADERS, throughput.table_rows(runs)))
        problems = throughput.check(runs)
        throughput.print_ratios(runs)
    if lat.get("reef_receipts") != lat.get("reef_requests"):
        problems.append("a Reef response came back without a receipt")
    print()
    print("Peak RSS (VmHWM) MiB: " + ", ".join(f"{k} {v:.1f}" for k, v in rss.items() if v is not None))
    for problem in problems:
        print("PROBLEM:", problem)
    reef_added = lat["added_ms"].get("reef", {})
    c64 = next((r for r in runs if r["target"] == "reef" and r["connections"] == 64), None)
    targets_met = {
        "added_p50_le_2ms": reef_added.get("p50", 1e9) <= 2.0,
        "added_p99_le_5ms": reef_added.get("p99", 1e9) <= 5.0,
        "reef_1000_rps_at_64": (c64 or {}).get("rps", 0) >= 1000 if c64 else None,
        # issue #41: the plain client and the openai SDK alike
        "added_p50_le_1ms": all(lat["added_ms"][n]["p50"] <= 1.0 for n in ("reef", "reef-sdk") if n in lat["added_ms"]),
        "added_p99_le_2ms": all(lat["added_ms"][n]["p99"] <= 2.0 for n in ("reef", "reef-sdk") if n in lat["added_ms"]),
        "reef_half_the_stub_at_64": throughput.stub_share(runs) >= 0.5 if c64 else None,
        "records_equal_receipts": not problems,
    }
    return {"machine": machine, "wall_s": round(time.monotonic() - began, 1), "latency": lat,
            "throughput": runs, "peak_rss_mib": rss, "peak_rss_mib_after_latency": rss_after_latency,
            "targets_met": targets_met, "problems": problems}
