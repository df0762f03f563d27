"""Sum an ncu --csv gpu__time_duration.sum dump by kernel name: python3 bench/ncu_sum.py dump.csv"""
import csv, sys, collections
rows = list(csv.reader(l for l in open(sys.argv[1]) if l.startswith('"')))
h = rows[0]; ki = h.index("Kernel Name"); vi = h.index("Metric Value")
tot = collections.OrderedDict(); cnt = collections.Counter()
for r in rows[1:]:
    name = r[ki][:60]; val = float(r[vi].replace(",", ""))
    tot[name] = tot.get(name, 0) + val; cnt[name] += 1
s = sum(tot.values())
for n, t in sorted(tot.items(), key=lambda x: -x[1]):
    print(f"{t/1e3:10.1f} us  x{cnt[n]:3d}  {n}")
print(f"{s/1e3:10.1f} us total kernel time")
