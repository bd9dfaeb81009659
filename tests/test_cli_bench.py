"""`infer bench offline` on the tiny random Llama, `infer bench serve` against a live
server on it; and the stdlib client under it."""

from __future__ import annotations

import asyncio
import json

from server_fixtures import tiny_server
from tiny_model import tiny_model_dir

from infer import cli
from infer.bench.http_client import HttpClient
from infer.bench.serve import percentile, send


def test_bench_offline_counts_every_token(tmp_path, capsys):
    out = tmp_path / "offline.json"
    code = cli.main(["bench", "offline", "--model", str(tiny_model_dir()), "--device", "cpu",
                     "--num-prompts", "5", "--input-len", "12", "--output-len", "7",
                     "--num-blocks", "64", "--block-size", "8", "--max-model-len", "128",
                     "--output-json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["requests"] == 5
    assert result["prompt_tokens"] == 5 * 12
    assert result["output_tokens"] == result["expected_output_tokens"] == 5 * 7
    assert result["output_tok_per_s"] == result["output_tokens"] / result["seconds"]
    assert result["engine"]["num_blocks"] == 64
    assert "requests/s" in capsys.readouterr().out


def test_bench_serve_against_a_live_server(tmp_path, capsys):
    out = tmp_path / "serve.json"
    with tiny_server("tiny") as server:
        code = cli.main(["bench", "serve", "--base-url", server.url, "--num-prompts", "7",
                         "--input-len", "5", "--output-len", "6", "--max-concurrency", "3",
                         "--request-rate", "200", "--output-json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert (result["requests"], result["completed"], result["errors"]) == (7, 7, 0)
    assert result["model"] == "tiny"
    assert result["output_tokens"] == 7 * 6
    assert result["ttft_s"]["p50"] > 0
    assert result["itl_s"]["p99"] >= result["itl_s"]["p50"] > 0
    printed = capsys.readouterr().out
    assert "TTFT" in printed
    assert "ITL" in printed


def test_bench_serve_reports_failures(capsys):
    with tiny_server("tiny") as server:
        # more tokens than the context holds: every request gets a 400
        assert cli.main(["bench", "serve", "--base-url", server.url, "--num-prompts", "2",
                         "--output-len", "500", "--num-warmups", "0"]) == 1
    assert "HTTP 400" in capsys.readouterr().err


def test_the_client_keeps_its_connection_alive():
    async def two_requests(url: str) -> tuple[list, int]:
        client = HttpClient(url)
        try:
            outcomes = [await send(client, "tiny", "hello there", 3) for _ in range(2)]
            return outcomes, len(client._idle)
        finally:
            await client.close()

    with tiny_server("tiny") as server:
        outcomes, idle = asyncio.run(two_requests(server.url))
    assert [o.error for o in outcomes] == [None, None]
    assert [o.output_tokens for o in outcomes] == [3, 3]
    assert idle == 1  # the second request went over the first one's connection


def test_percentile_interpolates_as_numpy():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 99) == 9.9
