"""Sum ncu's per-kernel metrics (--csv, gpu__time_duration.sum and optionally dram__bytes.sum) by kernel name:
launches, total time, time per launch, and DRAM bandwidth where the bytes were measured."""
import collections
import csv
import sys

rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head = rows[0]
col = {name: head.index(name) for name in ("ID", "Kernel Name", "Metric Name", "Metric Value")}
per_launch = collections.defaultdict(dict)  # launch id -> {"name": ..., metric: value}
for r in rows[1:]:
    try:
        value = float(r[col["Metric Value"]].replace(",", ""))
    except ValueError:
        continue
    launch = per_launch[r[col["ID"]]]
    name = r[col["Kernel Name"]].replace("(anonymous namespace)::", "").replace("<unnamed>::", "").replace("void ", "")
    launch["name"] = name.split("(")[0].split("<")[0]
    launch[r[col["Metric Name"]]] = value
time_ns = collections.defaultdict(float)
dram = collections.defaultdict(float)
count = collections.Counter()
for launch in per_launch.values():
    name = launch["name"]
    time_ns[name] += launch.get("gpu__time_duration.sum", 0.0)
    dram[name] += launch.get("dram__bytes.sum", 0.0)
    count[name] += 1
for name, ns in sorted(time_ns.items(), key=lambda kv: -kv[1]):
    bw = f"{dram[name] / ns / 1e3:6.2f} TB/s" if dram[name] and ns else ""  # bytes / ns = GB/s
    print(f"{name[:44]:44s} {count[name]:5d} x {ns / count[name] / 1e3:8.1f} us = {ns / 1e6:8.3f} ms  {bw}")
total = sum(time_ns.values())
print(f"{'total':44s} {sum(count.values()):5d} launches        {total / 1e6:8.3f} ms  "
      f"{sum(dram.values()) / total / 1e3 if total else 0:6.2f} TB/s")
