"""`infer bench`: the offline API's throughput (`offline.py`) and a server's under load
(`serve.py`, over the stdlib HTTP client of `http_client.py`). The scripts of benchmarks/
build on the same pieces."""
