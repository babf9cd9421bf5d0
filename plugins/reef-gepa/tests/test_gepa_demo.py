"""The runnable example, end to end through a real Reef server: pull, infer, report, learn, publish."""

from reef_gepa.examples import FACTS
from reef_gepa.examples.demo import run_demo


def test_demo_prompt_improves_release_by_release(tmp_path):
    lines = []
    history = run_demo(4, data_dir=tmp_path, log=lines.append)
    scores = [row["val_score"] for row in history]
    releases = [row["release_id"] for row in history]
    assert scores == [0.25, 0.5, 0.75, 1.0], lines
    assert len(set(releases)) == 4  # each round's reports produced a new release
    assert all(fact in history[-1]["prompt"] for fact in FACTS.values())
    # Every inference of a round was served (x-reef-release-id) by the release the round before published,
    # and GEPA took the parent's minibatch from that recorded traffic without re-running it.
    assert [row["served_by"] for row in history[1:]] == [[r] for r in releases[:-1]]
    assert [row["metrics"]["episodes_reused"] for row in history] == [3, 3, 3, 3]
    assert "5 releases" in lines[-1]  # the creation release plus one per round


def test_verify_mentions_takes_the_code_in_a_sentence_and_nothing_else():
    from reef_gepa.examples import verify_mentions

    task = {"answer": "ALP-7"}
    assert verify_mentions("ALP-7", task) == verify_mentions("The code of item 7 is ALP-7.", task) == 1.0
    for wrong in ("ALP-7 or BET-7", "ALP-71", "alp-7", "I do not know the code of item 7.", ""):
        assert verify_mentions(wrong, task) == 0.0, wrong
