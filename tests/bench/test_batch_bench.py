"""``python -m bench batch`` runs end to end on the tiny model: both modes timed, the sameness check and the kernel's
path reported."""

from __future__ import annotations

import argparse

from bench import batch


def test_bench_batch_compares_one_client_with_concurrent_clients_on_the_tiny_model(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    batch.add_arguments(parser)
    args = parser.parse_args(["--model", "tiny", "--cache", str(tmp_path), "--rounds", "1", "--tokens", "6",
                              "--concurrency", "3", "--threads", "1"])
    result = batch.run(args)
    assert result["problems"] == [] and result["same_tokens"]
    assert set(result["rates"]) == {"1 client", "3 clients"} and result["ratio"] > 0
    assert result["kernel"] in ("amx", "avx512", "c", "none (torch)")
    assert 1 <= result["max_rows"] <= 3
    out = capsys.readouterr().out
    assert f"bf16 products on {result['kernel']}" in out and "x 1 client" in out
