"""FakeUpstream fidelity: the official SDKs accept its answers; control routes and subprocess mode work."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from reef_core.testing import FakeUpstreamControl, serve_fake_upstream


def test_sdks_accept_the_fake(fake, api_key):
    _, url = fake
    oc = openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0)
    r = oc.chat.completions.create(model="m", messages=[{"role": "user", "content": "a b"}], stop=[" b"])
    assert r.choices[0].message.content == "echo: a" and r.choices[0].finish_reason == "stop"
    with oc.chat.completions.stream(model="m", messages=[{"role": "user", "content": "a b c"}], max_tokens=2) as s:
        events = [e.type for e in s]
        final = s.current_completion_snapshot
    assert final.choices[0].message.content == "echo: a " and final.choices[0].finish_reason == "length"
    assert events[0] == "chunk" and "content.done" in events
    ac = anthropic.Anthropic(base_url=url, api_key=api_key, max_retries=0)
    with ac.messages.stream(model="m", max_tokens=9, messages=[{"role": "user", "content": "x y"}],
                            stop_sequences=["y"]) as s:
        msg = s.get_final_message()
    assert msg.content[0].text == "echo: x " and msg.stop_reason == "stop_sequence" and msg.stop_sequence == "y"
    assert ac.messages.count_tokens(model="m", messages=[{"role": "user", "content": "x y z"}]).input_tokens == 3
    with pytest.raises(anthropic.BadRequestError):  # the fake validates like the real API
        ac.messages.create(model="m", max_tokens=5, messages=[{"role": "system", "content": "no"}])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "a"}])


def test_subprocess_mode_and_control_routes():
    with serve_fake_upstream(mode="process") as url, FakeUpstreamControl(url) as ctl:
        ctl.faults({"status": 503, "fail_next": 2, "route": "chat"})
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        codes = [httpx.post(url + "/v1/chat/completions", json=body).status_code for _ in range(3)]
        assert codes == [503, 503, 200]
        stats = ctl.stats()
        assert stats["requests"] == 3 and stats["faults_applied"] == 2 and stats["pending_faults"] == 0
        assert ctl.requests()[-1]["body"] == body
        ctl.reset()
        assert ctl.stats()["requests"] == 0
