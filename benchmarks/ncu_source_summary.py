"""The SASS instructions where a kernel's warps stall most, from ncu's source page as CSV
(`ncu --section SourceCounters --page source --print-source sass --csv ...`): the top rows by the sampled stalls,
with their share of all samples and the running total.

    python benchmarks/ncu_source_summary.py FILE.csv [--top 40]

The column of samples is the first whose name has "Sampling" and "All" in it (else "Sampling"); where the CSV has
none (another ncu version), the first lines are printed as they are."""
import argparse
import csv


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=40)
    opts = parser.parse_args(argv)
    rows = list(csv.reader(open(opts.csv, errors="replace")))
    head_at = next((i for i, r in enumerate(rows) if any("Sampling" in c for c in r)), None)
    if head_at is None:
        print("no sampling column; the first lines:")
        for r in rows[:40]:
            print(",".join(r)[:200])
        return 1
    head = rows[head_at]
    pick = [i for i, c in enumerate(head) if "Sampling" in c and "All" in c] or \
        [i for i, c in enumerate(head) if "Sampling" in c]
    col = pick[0]
    text = next((i for i, c in enumerate(head) if c.strip() in ("Source", "# Source")), len(head) - 1)
    address = next((i for i, c in enumerate(head) if "Address" in c), None)

    def number(r):
        try:
            return float(r[col].replace(",", ""))
        except (ValueError, IndexError):
            return 0.0

    body = [r for r in rows[head_at + 1:] if len(r) == len(head)]
    total = sum(number(r) for r in body) or 1.0
    print(f"{len(body)} instructions, {total:.0f} samples ({head[col]})")
    running = 0.0
    for r in sorted(body, key=number, reverse=True)[:opts.top]:
        running += number(r)
        where = r[address] if address is not None else ""
        print(f"{100 * number(r) / total:5.1f}% {100 * running / total:5.1f}%  {where:>8s}  {r[text][:110]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
