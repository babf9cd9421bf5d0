"""``reef_core.client`` against a live ``reef serve``: both SDKs, plain and streamed, sync and async."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from reef_core.client import AsyncReefClient, BadRequest, NotFound, ReefClient, Unauthorized
from reef_core.client.tree import SIDECAR, read_sidecar, tree_digest, encode_files
from reef_core.testing.fixtures import wait_until

MESSAGES = [{"role": "user", "content": "say hello"}]


def _client(server, scenario, **kwargs) -> ReefClient:
    return ReefClient(server.url, scenario=scenario, token=server.token, **kwargs)


def _record(reef: ReefClient, record_id: str) -> dict:
    return reef.record(record_id)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_openai_receipts_and_report_last(live_reef, stream):
    scenario = f"oa-{int(stream)}"
    with _client(live_reef, scenario, tags={"session": "s-1"}) as reef:
        chat = reef.openai()
        for text in ("first", "second"):
            if stream:
                chunks = list(chat.chat.completions.create(model="m", messages=[{"role": "user", "content": text}],
                                                           stream=True))
                assert any(c.choices for c in chunks)
            else:
                answer = chat.chat.completions.create(model="m", messages=[{"role": "user", "content": text}])
                assert answer.choices[0].message.content
        receipts = reef.receipts.all()
        assert len(receipts) == 2 and all(r.streamed is stream for r in receipts)
        stored = _record(reef, receipts[1].record_id)
        assert stored["request_type"] == "inference" and stored["tags"] == {"session": "s-1"}
        assert "second" in json.dumps(stored["payload"])  # the receipt names the exchange it came with
        report = reef.report(score=1.0, feedback="good", references="last")
        row = _record(reef, report["agent_record_id"])
        assert row["references"] == [receipts[1].record_id] and row["score"] == 1.0


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_anthropic_receipts(live_reef, stream):
    scenario = f"an-{int(stream)}"
    with _client(live_reef, scenario) as reef:
        messages = reef.anthropic().messages
        if stream:
            with messages.stream(model="m", max_tokens=16, messages=MESSAGES) as events:
                assert events.get_final_text()
        else:
            assert messages.create(model="m", max_tokens=16, messages=MESSAGES).content
        (receipt,) = reef.receipts.all()
        assert receipt.streamed is stream and receipt.complete
        assert _record(reef, receipt.record_id)["request_type"] == "inference"
        report = reef.report(score=0.5, references="session")
        assert _record(reef, report["agent_record_id"])["references"] == [receipt.record_id]
        assert reef.receipts.session() == []  # a session report closes the session


class LoseFirstAnswer(httpx.BaseTransport):
    """Delivers every request, but answers the first report with a 503 as if its answer was lost on the way."""

    def __init__(self):
        self.inner = httpx.HTTPTransport()
        self.reports = 0

    def handle_request(self, request):
        response = self.inner.handle_request(request)
        if request.url.path == "/reef/report":
            self.reports += 1
            if self.reports == 1:
                response.read()
                return httpx.Response(503, json={"error": {"message": "lost"}})
        return response


def test_a_retried_report_makes_one_record(live_reef):
    transport = LoseFirstAnswer()
    with _client(live_reef, "retry", transport=transport, backoff_s=0.01) as reef:
        reef.openai().chat.completions.create(model="m", messages=MESSAGES)
        answer = reef.report(score=1.0, references="last")
        assert transport.reports == 2
        reports = [r for r in reef.records() if r["request_type"] == "report"]
        assert [r["agent_record_id"] for r in reports] == [answer["agent_record_id"]]


def test_typed_errors_carry_the_server_message(live_reef):
    with _client(live_reef, "errors", retries=0) as reef:
        with pytest.raises(BadRequest, match="not a stored record") as refused:
            reef.report(score=1.0, references=["no-such-receipt"])
        assert refused.value.status == 400
        with pytest.raises(NotFound, match="unknown scenario"):
            reef.harness()
    with ReefClient(live_reef.url, scenario="errors", token="wrong", retries=0) as reef:
        with pytest.raises(Unauthorized):
            reef.report(score=1.0, references=None)
    with pytest.raises(ValueError, match="no receipt"):
        _client(live_reef, "errors").report(score=1.0)


def test_harness_pull_writes_the_exact_tree_and_follows_releases(live_reef, tmp_path):
    with _client(live_reef, "tree") as reef:
        reef.openai().chat.completions.create(model="m", messages=MESSAGES)
        first_tree = {"AGENTS.md": "Be brief.\n", "skills/a/SKILL.md": "no newline at end", "ü.md": "é"}
        before = reef.releases()
        reef.report(score=1.0, feedback={"tree": first_tree})
        first = reef.wait_for_release(after=before[-1]["release_id"] if before else None, timeout=60)
        pulled = reef.harness(tmp_path)
        assert pulled["release_id"] == first["release_id"]
        on_disk = {p.relative_to(tmp_path).as_posix(): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
        assert on_disk.pop(SIDECAR)
        assert on_disk == encode_files(first_tree)
        sidecar = read_sidecar(tmp_path)
        assert sidecar["release_id"] == first["release_id"] and sidecar["tree_sha256"] == tree_digest(on_disk)

        reef.openai().chat.completions.create(model="m", messages=MESSAGES)
        reef.report(score=1.0, feedback={"tree": {"AGENTS.md": "Be briefer.\n"}})
        second = reef.wait_for_release(after=first["release_id"], timeout=60)
        assert reef.harness(tmp_path)["written"] == {"written": ["AGENTS.md"],
                                                     "deleted": ["skills/a/SKILL.md", "ü.md"]}
        assert read_sidecar(tmp_path)["release_id"] == second["release_id"]
        assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == [SIDECAR, "AGENTS.md"]
        assert reef.status()["scenario"] == "tree"


def test_async_client(live_reef):
    async def run():
        async with AsyncReefClient(live_reef.url, scenario="async", token=live_reef.token) as reef:
            chat = reef.openai()
            stream = await chat.chat.completions.create(model="m", messages=MESSAGES, stream=True)
            async for _chunk in stream:
                pass
            await reef.anthropic().messages.create(model="m", max_tokens=8, messages=MESSAGES)
            report = await reef.report(score=1.0, references="session")
            row = await reef.record(report["agent_record_id"])
            return [r.record_id for r in reef.receipts.all()], row, await reef.records()

    receipts, row, records = asyncio.run(run())
    assert len(receipts) == 2 and row["references"] == receipts
    assert [r["request_type"] for r in records] == ["inference", "inference", "report"]
