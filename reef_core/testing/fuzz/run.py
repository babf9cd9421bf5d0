"""The fuzz runner: drives every route's strategy against a live ``reef serve`` and checks the invariants.

Invariants (each violation is a :class:`Failure`, grouped by cause, smallest example kept):

* ``5xx``: no response has a status >= 500 (the cause is read from the server's log: exception and frame);
* ``dropped``: no connection ends before a complete response, or closes after one without saying so;
* ``scenario created by a refused request``: after every batch, the scenarios listed by the admin
  ``GET /reef/scenarios`` are those set-up created plus those named by requests that were answered < 400;
* ``rss``: the server's resident memory grows by less than ``rss_limit_mib`` over the run (after warm-up).

Failures do not stop the run: it goes through all its cases and reports every distinct failure.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, seed as hypothesis_seed, settings

from .cases import Case
from .strategies import WEIGHTS, Pools, route_strategies
from .wire import Dropped, Reply, Wire

FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Failed|Interrupt|Warning)[\w.]*)(?::\s?(.*))?$")


@dataclass
class Failure:
    invariant: str
    op: str
    status: int | str | None
    cause: str
    example: Case | None
    detail: str = ""
    count: int = 1

    def key(self) -> tuple:
        return self.invariant, self.op, self.status, self.cause


@dataclass
class Target:
    """A live server: where it listens, its process id and log, the tokens and the scenario pools."""

    host: str
    port: int
    pid: int
    log_path: Path
    pools: Pools


@dataclass
class FuzzResult:
    cases: int = 0
    by_route: Counter = field(default_factory=Counter)
    statuses: dict = field(default_factory=lambda: defaultdict(Counter))
    failures: dict = field(default_factory=dict)
    rss_start_mib: float = 0.0
    rss_end_mib: float = 0.0
    wall_s: float = 0.0
    scenarios: int = 0

    @property
    def rss_growth_mib(self) -> float:
        return self.rss_end_mib - self.rss_start_mib

    def add(self, failure: Failure) -> None:
        known = self.failures.get(failure.key())
        if known is None:
            self.failures[failure.key()] = failure
            return
        known.count += 1
        if failure.example is not None and (known.example is None or failure.example.size() < known.example.size()):
            known.example, known.detail = failure.example, failure.detail

    def report(self) -> str:
        lines = [f"{self.cases} cases in {self.wall_s:.1f} s over {len(self.by_route)} routes; "
                 f"RSS {self.rss_start_mib:.0f} -> {self.rss_end_mib:.0f} MiB ({self.rss_growth_mib:+.0f}); "
                 f"{self.scenarios} scenarios at the end; {len(self.failures)} distinct failure(s)"]
        for route in sorted(self.statuses):
            counts = ", ".join(f"{s}: {n}" for s, n in sorted(self.statuses[route].items(), key=lambda kv: str(kv[0])))
            lines.append(f"  {route}: {counts}")
        for failure in sorted(self.failures.values(), key=lambda f: (f.invariant, f.op, str(f.status))):
            lines.append(f"\n[{failure.invariant}] {failure.op} -> {failure.status} x{failure.count}: {failure.cause}")
            if failure.detail:
                lines.append(f"  detail: {failure.detail}")
            if failure.example is not None:
                lines.append(f"  note: {failure.example.note}")
                lines.append("  " + failure.example.describe().replace("\n", "\n  "))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"cases": self.cases, "wall_s": round(self.wall_s, 1), "by_route": dict(self.by_route),
                "statuses": {r: {str(s): n for s, n in c.items()} for r, c in self.statuses.items()},
                "rss_start_mib": round(self.rss_start_mib, 1), "rss_end_mib": round(self.rss_end_mib, 1),
                "scenarios": self.scenarios,
                "failures": [{"invariant": f.invariant, "route": f.op, "status": f.status, "cause": f.cause,
                              "detail": f.detail, "count": f.count, "note": f.example.note if f.example else None,
                              "example": f.example.describe() if f.example else None}
                             for f in self.failures.values()]}


def rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` and its child processes, in MiB."""
    total, frontier = 0, [pid]
    while frontier:
        current = frontier.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
            total += int(re.search(r"VmRSS:\s+(\d+)", status).group(1))
            frontier += [int(c) for c in Path(f"/proc/{current}/task/{current}/children").read_text().split()]
        except (OSError, AttributeError):
            continue
    return total / 1024


class Runner:
    """Runs cases one at a time on one kept-alive connection and checks the per-case invariants."""

    def __init__(self, target: Target, result: FuzzResult, batch: int = 50):
        self.target, self.result, self.batch = target, result, batch
        self.wire = Wire(target.host, target.port)
        self.log_offset = target.log_path.stat().st_size if target.log_path.exists() else 0
        #: scenario names explained by a request answered < 400, and the refused cases that named each name
        self.allowed: set[str] = set()
        self.refused: dict[str, Case] = {}
        self.refused_status: dict[str, int | str] = {}
        self.since_check = 0
        self.previous: tuple[Case, int] | None = None
        self.allowed.update(self.scenarios())  # set-up's scenarios

    # -- per case --------------------------------------------------------------------------------

    def execute(self, case: Case) -> Reply | None:
        result = self.result
        if self.wire.closed_after_reply() and self.previous is not None:
            result.add(Failure("dropped", self.previous[0].op, self.previous[1], "kept-alive connection closed after "
                               "the response without `connection: close`", self.previous[0]))
        result.cases += 1
        result.by_route[case.op] += 1
        host = f"{self.target.host}:{self.target.port}"
        try:
            reply = self.wire.request(case.to_bytes(host))
        except Dropped as exc:
            result.statuses[case.op]["dropped"] += 1
            cause, detail = self._logged_cause(wait=True)
            result.add(Failure("dropped", case.op, "dropped", f"{_generic(str(exc))}; server log: {cause}", case,
                               detail))
            self._remember(case, "dropped")
            self.previous = None
            return None
        result.statuses[case.op][reply.status] += 1
        if reply.status >= 500:
            cause, detail = self._logged_cause()
            if cause == "nothing logged":
                cause = f"nothing logged; answered {_generic(reply.body[:100].decode('utf-8', 'replace'))}"
            result.add(Failure("5xx", case.op, reply.status, cause, case, detail))
        else:
            self.log_offset = self._log_size()
        self._remember(case, reply.status)
        self._learn(case, reply)
        self.previous = (case, reply.status)
        self.since_check += 1
        if self.since_check >= self.batch:
            self.check_scenarios()
        return reply

    def _remember(self, case: Case, status: int | str) -> None:
        for raw in case.names:
            for name in _decodings(raw):
                if isinstance(status, int) and status < 400:
                    self.allowed.add(name)
                elif name not in self.refused or _likelier_creator(case, status, self.refused[name],
                                                                    self.refused_status[name]):
                    self.refused[name], self.refused_status[name] = case, status

    def _learn(self, case: Case, reply: Reply) -> None:
        """Receipts handed out become references and record ids for later cases."""
        pools = self.target.pools
        receipt = reply.header("x-reef-agent-record-id")
        if receipt is None and case.stream and reply.status == 200:
            found = re.search(rb'"agent_record_id"\s*:\s*"([^"]+)"', reply.body)
            receipt = found.group(1).decode() if found else None
        if receipt and case.names and case.route.startswith("/v1/"):
            name = case.names[0].decode("latin-1")
            receipts = pools.receipts.setdefault(name, [])
            if len(receipts) < 200:
                receipts.append(receipt)

    # -- shrinking ---------------------------------------------------------------------------------

    def outcome(self, case: Case) -> tuple:
        """(status or "dropped", logged cause) of sending ``case`` once more on a new connection."""
        wire = Wire(self.target.host, self.target.port)
        self.log_offset = self._log_size()
        try:
            reply = wire.request(case.to_bytes(f"{self.target.host}:{self.target.port}"))
        except Dropped:
            return "dropped", self._logged_cause(wait=True)[0]
        finally:
            wire.close()
        if reply.status < 500:
            return reply.status, None
        return reply.status, self._logged_cause()[0]

    def reduce(self, failure: Failure, budget: int = 30) -> None:
        """Shrink the example of a 5xx or drop: drop optional headers, top-level body fields and the odd scenario
        name one at a time, keeping each change that still fails the same way (same status and logged cause)."""
        case = failure.example
        if case is None or failure.invariant not in ("5xx", "dropped") or failure.status not in ("dropped",) and \
                not (isinstance(failure.status, int) and failure.status >= 500):
            return
        wanted = self.outcome(case)
        if wanted[0] != failure.status:
            failure.detail += " (did not reproduce when sent again)"
            return
        left = [budget]

        def accept(candidate: Case) -> bool:
            left[0] -= 1
            return left[0] >= 0 and self.outcome(candidate) == wanted

        failure.example = _smaller(case, self.target.pools.plain[0], accept)

    # -- server log ------------------------------------------------------------------------------

    def _log_size(self) -> int:
        try:
            return self.target.log_path.stat().st_size
        except OSError:
            return 0

    def _logged_cause(self, wait: bool = False) -> tuple[str, str]:
        """The last exception the server logged since the previous case: type, message and innermost Reef frame."""
        deadline = time.monotonic() + (1.0 if wait else 0.2)
        while True:  # the traceback is written before the response, except around a dropped connection
            size = self._log_size()
            if size > self.log_offset or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        with open(self.target.log_path, "rb") as handle:
            handle.seek(self.log_offset)
            text = handle.read(size - self.log_offset).decode("utf-8", "replace")
        self.log_offset = size
        return summarize_traceback(text)

    # -- batch invariants ------------------------------------------------------------------------

    def scenarios(self) -> list[str]:
        token = self.target.pools.admin_token
        raw = (f"GET /reef/scenarios HTTP/1.1\r\nhost: {self.target.host}\r\n"
               f"authorization: Bearer {token}\r\n\r\n").encode()
        admin = Wire(self.target.host, self.target.port)  # its own connection: idle ones time out
        try:
            reply = admin.request(raw)
        finally:
            admin.close()
        assert reply.status == 200, (reply.status, reply.body[:300])
        return [row["scenario"] for row in json.loads(reply.body)["scenarios"]]

    def check_scenarios(self) -> None:
        self.since_check = 0
        names = self.scenarios()
        self.result.scenarios = len(names)
        for name in names:
            if name in self.allowed:
                continue
            self.allowed.add(name)  # report each once
            case = self.refused.get(name)
            status = self.refused_status.get(name)
            refused_by = "a 4xx" if isinstance(status, int) and status < 500 else "a failed request (5xx or dropped)"
            self.result.add(Failure(f"scenario created by {refused_by}", case.op if case else "?", status,
                                    "a scenario exists that only refused requests named" if case else
                                    "a scenario exists that no request of the run named",
                                    case, f"scenario {name[:80]!r}"))


_KEEP_HEADERS = (b"authorization", b"x-api-key", b"content-type")


def _smaller(case: Case, plain_scenario: str, accept):
    """Shrink ``case``: each optional header removed (an odd scenario name replaced by ``plain_scenario``), then
    each top-level body field removed, keeping every step ``accept(candidate)`` says still fails the same way."""
    for name in dict.fromkeys(n for n, _ in case.headers):
        if name.lower() in _KEEP_HEADERS:
            continue
        if name == b"x-reef-scenario":
            headers = [(n, plain_scenario.encode() if n == name else v) for n, v in case.headers]
        else:
            headers = [(n, v) for n, v in case.headers if n != name]
        candidate = dataclasses.replace(case, headers=headers, note=case.note + f"; reduced: -{name.decode()}")
        if headers != case.headers and accept(candidate):
            case = candidate
    try:
        body = json.loads(case.body) if case.body else None
    except (ValueError, RecursionError):
        return case
    if not isinstance(body, dict):
        return case
    for key in list(body):
        trimmed = {k: v for k, v in body.items() if k != key}
        try:
            data = json.dumps(trimmed).encode()
        except ValueError:
            continue
        candidate = dataclasses.replace(case, body=data)
        if accept(candidate):
            case, body = candidate, trimmed
    return case


def _likelier_creator(case: Case, status, than: Case, than_status) -> bool:
    """Which refused case to show for a scenario that should not exist: one of the routes that create scenarios
    (inference and reports, named by header) before any other, one past authentication (not 401/403), then the
    smaller."""
    creates = lambda c: c.method == "POST" and (c.route.startswith("/v1/") or c.route in (
        "/reef/report", "/reef/records", "/reef/records/batch"))  # noqa: E731
    rank = lambda c, s: (not creates(c), s in (401, 403), c.size())  # noqa: E731
    return rank(case, status) < rank(than, than_status)


def _decodings(raw: bytes) -> set[str]:
    """The names a server could make of header/path bytes (stripped, as latin-1 or UTF-8)."""
    names = {raw.decode("latin-1").strip()} if raw.strip() else set()
    try:
        names.add(raw.decode("utf-8").strip())
    except UnicodeDecodeError:
        pass
    return names


def _generic(message: str) -> str:
    return re.sub(r"\d+", "N", message)


def summarize_traceback(text: str) -> tuple[str, str]:
    """(``ExcType at file:line in func``, its message) of the last traceback in ``text``."""
    lines = text.splitlines()
    for index in range(len(lines) - 1, -1, -1):
        found = EXCEPTION.match(lines[index].strip())
        if not found:
            continue
        frames = [m for m in FRAME.finditer("\n".join(lines[:index]))]
        ours = [m for m in frames if "reef" in m.group(1) and "site-packages" not in m.group(1)]
        frame = (ours or frames or [None])[-1]
        where = f" at {Path(frame.group(1)).name}:{frame.group(2)} in {frame.group(3)}" if frame else ""
        return f"{found.group(1)}{where}", (found.group(2) or "")[:200]
    # No traceback: the last warning or error line, if any, as detail (INFO lines say nothing about the cause).
    notable = [line for line in lines if " WARNING " in line or " ERROR " in line or line.startswith(("WARNING", "ERROR"))]
    return "nothing logged", notable[-1][:200] if notable else ""


def _apportion(total: int, weights: list[int]) -> list[int]:
    """``total`` split by ``weights`` (largest remainders, so the shares add up to ``total``), each at least 1."""
    whole = sum(weights)
    exact = [total * w / whole for w in weights]
    shares = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: exact[i] - shares[i], reverse=True)
    for i in by_remainder[:total - sum(shares)]:
        shares[i] += 1
    return [max(1, share) for share in shares]


def fuzz(target: Target, cases: int, *, seed: int | None = 0, rss_warmup: int = 100, batch: int = 50,
         routes: list[str] | None = None, progress=None, reduce: bool = True) -> FuzzResult:
    """Run about ``cases`` cases spread over the routes (by ``WEIGHTS``); return what was observed.

    ``seed``: a fixed seed gives the same cases on every run (the suite); ``None`` draws new ones.
    ``reduce``: after the run, shrink each 5xx/drop example (see :meth:`Runner.reduce`)."""
    result = FuzzResult()
    runner = Runner(target, result, batch)
    strategies = route_strategies(target.pools)
    names = routes or list(strategies)
    started = time.monotonic()
    result.rss_start_mib = rss_mib(target.pid)
    warm = False
    # Interleave routes in rounds, so that state built by one (receipts, deletions) feeds the others.
    rounds = max(1, cases // 400)
    weights = [WEIGHTS.get(name, 1) for name in names]
    for round_index in range(rounds):
        quota = cases // rounds + (1 if round_index < cases % rounds else 0)
        for name, share in zip(names, _apportion(quota, weights)):
            _run_route(runner, strategies[name], share, None if seed is None else seed * 1000 + round_index)
            if not warm and result.cases >= rss_warmup:
                result.rss_start_mib, warm = rss_mib(target.pid), True
            if progress is not None:
                progress(result)
    runner.check_scenarios()
    result.rss_end_mib = rss_mib(target.pid)
    if reduce:
        for failure in list(result.failures.values()):
            runner.reduce(failure)
    result.wall_s = time.monotonic() - started
    runner.wire.close()
    return result


def _run_route(runner: Runner, strategy, examples: int, fixed_seed: int | None) -> None:
    config = settings(max_examples=examples, deadline=None, database=None, derandomize=False,
                      phases=[Phase.generate], suppress_health_check=list(HealthCheck), report_multiple_bugs=False)

    @config
    @given(strategy)
    def one(case: Case) -> None:
        runner.execute(case)

    if fixed_seed is not None:
        one = hypothesis_seed(fixed_seed)(one)
    one()
