"""``python -m bench stream``'s arithmetic: the server's per-thread split (main thread, engine thread, the rest; the
process total ``top -H`` shows on the main thread's row), the rates, the composed overrides and the argument checks.
The end-to-end run (three processes on SmolLM2) is a benchmark, not a test."""

from __future__ import annotations

import argparse
import os
import time

import pytest

from bench import stream


def test_thread_split_separates_the_main_thread_from_the_busiest_other_one():
    pid = 100
    before = {100: 1.0, 101: 5.0, 102: 0.5}
    after = {100: 1.25, 101: 7.0, 102: 0.75, 103: 0.5}  # 103 started in between
    split = stream.thread_split(pid, before, after)
    assert split == pytest.approx({"main_s": 0.25, "busiest_other_s": 2.0, "rest_s": 0.75, "total_s": 3.0})


def test_thread_cpu_charges_the_main_thread_with_its_own_work_only():
    if not os.path.isdir(f"/proc/{os.getpid()}/task"):
        pytest.skip("no /proc")
    before = stream.thread_cpu(os.getpid())
    start = time.thread_time()
    while time.thread_time() - start < 0.2:  # 0.2 s of this thread's CPU, however loaded the machine is
        pass
    after = stream.thread_cpu(os.getpid())
    split = stream.thread_split(os.getpid(), before, after)
    assert split["main_s"] >= 0.15 and split["busiest_other_s"] < 0.1


def test_rates_are_per_request_and_over_the_whole_run():
    got = stream.rates([{"tokens": 128, "s": 2.0, "cpu_s": 1.5}, {"tokens": 128, "s": 4.0, "cpu_s": 1.7},
                        {"tokens": 128, "s": 1.0, "cpu_s": 1.6}])
    assert got["tokens"] == 128
    assert got["tok_s_median"] == pytest.approx(64.0) and got["tok_s_best"] == pytest.approx(128.0)
    assert got["tok_s_total"] == pytest.approx(384 / 7.0) and got["cpu_s_median"] == pytest.approx(1.6)


def test_the_served_engine_is_composed_like_reef_serve():
    assert stream.recipe_overrides("smollm2", ["engine.num_threads=2"]) == [
        "+recipe=sao", "engine.model=smollm2", "engine.num_threads=2"]
    assert stream.recipe_overrides("tiny", []) == ["+recipe=sao", "+sao_profile=tiny"]


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--tokens", "0"], ["--threads", "0"], ["--concurrency", "0"],
                                  ["--concurrency", "8", "--rounds", "0"]])
def test_bad_arguments_are_refused_before_anything_starts(argv):
    parser = argparse.ArgumentParser()
    stream.add_arguments(parser)
    with pytest.raises(SystemExit):
        stream.run(parser.parse_args(argv))


def test_concurrent_requests_are_different_greedy_streams():
    bodies = stream.concurrent_bodies(8, 32)
    assert len({b["messages"][0]["content"] for b in bodies}) == 8
    assert all(b["temperature"] == 0 and b["stream"] and b["max_tokens"] == 32 for b in bodies)
    assert all(b["stream_options"] == {"include_usage": True} for b in bodies)


def test_a_concurrent_stream_is_read_to_its_text_and_usage():
    import asyncio
    import json

    import httpx

    def handler(request):
        assert request.headers["x-reef-scenario"] == stream.SCENARIO
        events = [{"choices": [{"delta": {"role": "assistant", "content": ""}}]},
                  {"choices": [{"delta": {"content": "Once"}}]}, {"choices": [{"delta": {"content": " upon"}}]},
                  {"choices": [], "usage": {"completion_tokens": 2}}]
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await stream._astream(client, "http://reef", stream.concurrent_bodies(1, 2)[0])

    assert asyncio.run(go()) == {"tokens": 2, "text": "Once upon"}


@pytest.mark.parametrize("argv, why", [(["--no-llama"], "--no-llama"), (["--model", "tiny"], "GGUF")])
def test_llama_cpp_is_skipped_with_the_reason(argv, why):
    parser = argparse.ArgumentParser()
    stream.add_arguments(parser)
    llama, skipped = stream._llama(parser.parse_args(argv), 1)
    assert llama is None and why in skipped


def test_the_per_cpu_ratio_compares_tokens_per_cpu_second():
    assert stream._per_cpu({"tokens": 128, "cpu_s_median": 2.0}, {"tokens": 64, "cpu_s_median": 0.5}) == \
        pytest.approx(0.5)
