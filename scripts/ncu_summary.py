"""Sum ncu's per-kernel durations (--csv --metrics gpu__time_duration.sum) by kernel name."""
import collections
import csv
import sys

rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head = rows[0]
name_col, value_col = head.index("Kernel Name"), head.index("Metric Value")
total = collections.defaultdict(float)
count = collections.Counter()
for r in rows[1:]:
    try:
        ns = float(r[value_col].replace(",", ""))
    except ValueError:
        continue
    name = r[name_col].split("(")[0].split("<")[0]
    total[name] += ns
    count[name] += 1
for name, ns in sorted(total.items(), key=lambda kv: -kv[1]):
    print(f"{name:40s} {count[name]:5d} launches {ns / 1e6:8.3f} ms  ({ns / count[name] / 1e3:7.1f} us each)")
print(f"{'total':40s} {sum(count.values()):5d} launches {sum(total.values()) / 1e6:8.3f} ms")
