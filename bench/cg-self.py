#!/usr/bin/env python3
"""Self and inclusive cost (Ir) per function from a callgrind output file, top N.
(callgrind_annotate 3.19 attributes everything to `clone` on dumps of these multi-threaded
Rust programs.)  usage: cg-self.py FILE [N] [REGEX-for-inclusive-listing]"""
import re, sys, collections
path = sys.argv[1]; top = int(sys.argv[2]) if len(sys.argv) > 2 else 30
pat = re.compile(sys.argv[3]) if len(sys.argv) > 3 else None
names = {}; self_c = collections.Counter(); incl = collections.Counter()
fn = None; in_call = False; total = 0
def name(tok):
    m = re.match(r'\((\d+)\)(?: (.*))?', tok)
    if not m: return tok
    if m.group(2): names[m.group(1)] = m.group(2)
    return names.get(m.group(1), tok)
for line in open(path, errors='replace'):
    line = line.rstrip('\n')
    if line.startswith('fn='):
        fn = name(line[3:]); continue
    if line.startswith('cfn='):
        cfn = name(line[4:]); continue
    if line.startswith(('cfi=', 'cfl=', 'cob=', 'fl=', 'fi=', 'fe=', 'ob=')):
        continue
    if line.startswith('calls='):
        in_call = True; continue
    if line and (line[0].isdigit() or line[0] in '+-*'):
        parts = line.split()
        if len(parts) < 2: continue
        try: c = int(parts[1])
        except ValueError: continue
        if in_call:
            in_call = False
            if cfn != fn: incl[fn] += c
        else:
            self_c[fn] += c; incl[fn] += c; total += c
print(f"total Ir: {total:,}\n--- self ---")
for f, c in self_c.most_common(top):
    print(f"{c:>14,} {100*c/total:5.1f}%  {f[:150]}")
if pat:
    print(f"--- inclusive, functions matching {pat.pattern} ---")
    rows = [(c, f) for f, c in incl.items() if pat.search(f)]
    for c, f in sorted(rows, reverse=True)[:top]:
        print(f"{c:>14,} {100*c/total:5.1f}%  {f[:150]}")
