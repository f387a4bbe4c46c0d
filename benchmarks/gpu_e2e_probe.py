"""Where does P/D TTFT go? 1P1D only, then the proxy's, P's and D's latency metrics."""
import asyncio, random, sys, urllib.request
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
from gpu_e2e import child, run_workload, summarize

log = Path("/tmp/probe"); log.mkdir(exist_ok=True)
common = ["serve", "--model", "llama-3.1-8b", "--load-format", "dummy", "--max-model-len", "1216"]
P = child(common + ["--kv-connector", "cuda_ipc", "--kv-role", "producer"], "0", log, "p")
D = child(common + ["--kv-connector", "cuda_ipc", "--kv-role", "consumer"], "1", log, "d")
try:
    P.wait_healthy(300); D.wait_healthy(300)
    X = child(["proxy", "--prefill", P.url, "--decode", D.url], None, log, "x"); X.wait_healthy(60)
    rng = random.Random(0)
    n, out_len = int(sys.argv[1]), int(sys.argv[2])
    prompts = [[rng.randrange(1000, 30000) for _ in range(1024)] for _ in range(n)]
    arrivals, t = [], 0.0
    for _ in prompts:
        arrivals.append(t)
        t += rng.expovariate(8.0)
    res, dur = asyncio.run(run_workload(X.url, "llama-3.1-8b", prompts, out_len, arrivals))
    print("TTFT", summarize(res, dur, out_len)["ttft"])
    print("TTFT by arrival", [round(r["ttft"], 3) for r in res])
    for name, c in (("proxy", X), ("P", P), ("D", D)):
        text = urllib.request.urlopen(c.url + "/metrics").read().decode()
        print(name, [l for l in text.splitlines() if ("_sum" in l or "_count" in l) and not l.startswith("#")])
finally:
    for c in (D, P):
        c.stop()
    X.stop()
