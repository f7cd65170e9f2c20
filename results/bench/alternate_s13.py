"""The thirteenth session's microbenchmarks' timing loop: each function once to warm up, then
``rounds`` rounds in which every function runs once, in turn; the median per function."""
import time


def run(fs, rounds=7):
    res = {k: [] for k in fs}
    for f in fs.values():
        f()
    for _ in range(rounds):
        for k, f in fs.items():
            s = time.perf_counter()
            f()
            res[k].append(time.perf_counter() - s)
    return {k: sorted(v)[rounds // 2] for k, v in res.items()}
