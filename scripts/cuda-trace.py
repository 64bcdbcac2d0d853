#!/usr/bin/env python3
"""Reads the "@T t0 t1 ctas threads cta sm" lines of a LUMA_CUDA_TRACE build
(cuda/launch.cuh: the first and last CTA of every kernel, the global timer
when each reached its wait and when the wait returned) and prints, for each
kernel shape (CTAs x threads) after each other shape (a step's kernels in
order), how long from its release (the earlier of its two recorded CTAs'
wait returns) to the next kernel's: the time it holds the chain, with the
handoff to the next. Also when the earlier of those CTAs reached the wait
against the release of the kernel before it
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
firsts, lasts = defaultdict(list), defaultdict(list)
for line in open(args[0]):
    if not line.startswith('@T '):
        continue
    t0, t1, ctas, threads, cta, _sm = (int(v) for v in line.split()[1:7])
    (firsts if cta == 0 else lasts)[(ctas, threads)].append((t1, t0))
# A kernel's first and last CTA records, paired in launch order within a
# shape (both come from every launch of a grid of two CTAs or more); by time
# where the counts differ (the latest launch of the shape released by the
# last CTA's own release). Its release is the earlier of the two CTAs'
# wait returns and its arrival the earlier of their waits: the first CTA's
# thread 0 can reach the wait late (mmv_heads' head warp makes the angles
# first), and a release read from it alone moved the time from one kernel
# to the one before it.
kernels = []   # (release, arrival, ctas, threads, last CTA's wait or None)
for shape, fs in firsts.items():
    fs.sort()
    ls = sorted(lasts.get(shape, []))
    pair = [None] * len(fs)
    if len(ls) == len(fs):
        pair = ls
    else:
        rel = [t1 for t1, _ in fs]
        for l in ls:
            j = bisect_right(rel, l[0] + 50) - 1
            if j >= 0:
                pair[j] = l
    for (t1, t0), l in zip(fs, pair):
        if l is None:
            kernels.append((t1, t0, shape[0], shape[1], None))
        else:
            kernels.append((min(t1, l[0]), min(t0, l[1]), shape[0], shape[1], l[1]))
kernels.sort()
kernels = kernels[skip:]
rows = defaultdict(lambda: {'dt': [], 'start': [], 'lead': [], 'last': []})
for i in range(1, len(kernels) - 1):
    rel, arr, g, b, lt0 = kernels[i]
    key = ((kernels[i - 1][2], kernels[i - 1][3]), (g, b))
    r = rows[key]
    r['dt'].append(kernels[i + 1][0] - rel)
    r['start'].append(arr - kernels[i - 1][0])
    r['lead'].append(rel - arr)
    if lt0 is not None:
        r['last'].append(lt0 - rel)
total = sum(sum(r['dt']) for r in rows.values())
print(f"{len(kernels)} kernels, {total / 1e3:.0f} us from the first release to the last")
print(f"{'after':>14} {'kernel':>14} {'count':>6} {'us to next':>10} {'share':>6} {'start us':>8} {'lead us':>8} "
      f"{'last us':>8}")
for key, r in sorted(rows.items(), key=lambda kv: -sum(kv[1]['dt'])):
    (pg, pb), (g, b) = key
    last_s = f"{median(r['last']) / 1e3:8.2f}" if r['last'] else f"{'':>8}"
    print(f"{pg:>8}x{pb:<5} {g:>8}x{b:<5} {len(r['dt']):6d} {median(r['dt']) / 1e3:10.2f} "
          f"{100 * sum(r['dt']) / total:5.1f}% {median(r['start']) / 1e3:8.2f} {median(r['lead']) / 1e3:8.2f} {last_s}")
