"""MEASURE: benchmark an OpenAI-compatible endpoint over HTTP (no engine, no torch).

workloads.py  prompts, lengths and arrival times        client.py  one streaming request → RequestRecord
metrics.py    records → TTFT/TPOT/ITL/E2E, goodput, SLO  runner.py  run_benchmark / run_sweep
plots.py      plots of saved results (matplotlib, lazy)  cli.py     `pdserve bench serve | sweep`
"""
