# usage: python results/bench/noise-s16.py BUSY_MS IDLE_MS &: a competing load beside a benchmark, busy BUSY ms then idle IDLE ms forever (an HTTP thread's share of a core)
import time, sys
busy, idle = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < busy: pass
    time.sleep(idle)
