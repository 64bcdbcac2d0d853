#!/usr/bin/env python3
"""Reads the "@T t0 t1 ctas threads cta sm" lines of a LUMA_CUDA_TRACE build
(cuda/launch.cuh: the first and last CTA of every kernel, the global timer
when each reached its wait and when the wait returned) and prints, for each
kernel shape (CTAs x threads) after each other shape (a step's kernels in
order), how long from its wait's return (its release) to the next kernel's:
the time it holds the chain, with the handoff to the next. Also when its
first CTA reached the wait against the release of the kernel before it
(start: negative, placed while that one ran; positive, only after it had
completed, as after a memset or a copy on the stream, or a graph's end),
how long before its own release it did (lead: placed early), and when its
last CTA did against the release (last: negative, placed before it;
positive, in a later wave).

usage: cuda-trace.py TRACE [--skip N]   (N: kernels to drop at the start)
"""
import signal
import sys
from bisect import bisect_right
from collections import defaultdict
from statistics import median

signal.signal(signal.SIGPIPE, signal.SIG_DFL)   # quiet when piped into head
args = [a for a in sys.argv[1:] if not a.startswith('--')]
skip = int(sys.argv[sys.argv.index('--skip') + 1]) if '--skip' in sys.argv else 0
if '--skip' in sys.argv:
    args.remove(sys.argv[sys.argv.index('--skip') + 1])
first, last = [], []
for line in open(args[0]):
    if not line.startswith('@T '):
        continue
    t0, t1, ctas, threads, cta, _sm = (int(v) for v in line.split()[1:7])
    (first if cta == 0 else last).append((t1, t0, ctas, threads))
first.sort()
first = first[skip:]
# a last CTA belongs to the latest kernel of its shape released by its own release
by_shape = defaultdict(list)
for i, (t1, _t0, g, b) in enumerate(first):
    by_shape[(g, b)].append((t1, i))
last_of = {}
for t1, t0, g, b in last:
    ks = by_shape.get((g, b))
    if not ks:
        continue
    j = bisect_right(ks, (t1 + 50, len(first))) - 1
    if j >= 0:
        i = ks[j][1]
        last_of[i] = t0 - first[i][0]
rows = defaultdict(lambda: {'dt': [], 'start': [], 'lead': [], 'last': []})
for i in range(1, len(first) - 1):
    t1, t0, g, b = first[i]
    key = ((first[i - 1][2], first[i - 1][3]), (g, b))
    r = rows[key]
    r['dt'].append(first[i + 1][0] - t1)
    r['start'].append(t0 - first[i - 1][0])
    r['lead'].append(t1 - t0)
    if i in last_of:
        r['last'].append(last_of[i])
total = sum(sum(r['dt']) for r in rows.values())
print(f"{len(first)} kernels, {total / 1e3:.0f} us from the first release to the last")
print(f"{'after':>14} {'kernel':>14} {'count':>6} {'us to next':>10} {'share':>6} {'start us':>8} {'lead us':>8} "
      f"{'last us':>8}")
for key, r in sorted(rows.items(), key=lambda kv: -sum(kv[1]['dt'])):
    (pg, pb), (g, b) = key
    last_s = f"{median(r['last']) / 1e3:8.2f}" if r['last'] else f"{'':>8}"
    print(f"{pg:>8}x{pb:<5} {g:>8}x{b:<5} {len(r['dt']):6d} {median(r['dt']) / 1e3:10.2f} "
          f"{100 * sum(r['dt']) / total:5.1f}% {median(r['start']) / 1e3:8.2f} {median(r['lead']) / 1e3:8.2f} {last_s}")
