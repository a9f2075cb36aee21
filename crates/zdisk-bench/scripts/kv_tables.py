#!/usr/bin/python3
"""The tables of docs/case-studies.md section 2 from the JSON lines of
kv-vs-rocksdb.sh: ops/s, p99/p99.9, CPU per op, logical/mapped/stored
bytes and RSS, and bytes written per operation, as Markdown.

Usage: kv_tables.py RESULTS.json
"""
import json,sys
rows=[json.loads(l) for l in open(sys.argv[1])]
eng=["kv","rocksdb-lz4","rocksdb-none"]
wl=["load","A","B","C","F","D"]
def g(e,w,k):
    for r in rows:
        if r["engine"]==e and r["workload"]==w: return r.get(k)
def f(x,d=0):
    if x is None: return "–"
    s=f"{x:,.{d}f}".replace(",", " ")
    return s
print("| workload | " + " | ".join(f"{e} ops/s" for e in eng) + " | kv ÷ rocksdb-lz4 |")
print("|---|"+"---|"*(len(eng)+1))
for w in wl:
    print(f"| {w} | " + " | ".join(f(g(e,w,'ops_per_s')) for e in eng) + f" | {g('kv',w,'ops_per_s')/g('rocksdb-lz4',w,'ops_per_s'):.2f}× |")
print()
print("| workload | " + " | ".join(f"{e} p99 / p99.9 µs" for e in eng) + " |")
print("|---|"+"---|"*len(eng))
for w in wl:
    print(f"| {w} | " + " | ".join(f"{f(g(e,w,'p99_us'))} / {f(g(e,w,'p999_us'))}" for e in eng) + " |")
print()
print("| workload | " + " | ".join(f"{e} CPU µs/op (client + zdisk{', nbdfuse' if e!='kv' else ''})" for e in eng) + " |")
print("|---|"+"---|"*len(eng))
for w in wl:
    print(f"| {w} | " + " | ".join(f"{f(g(e,w,'cpu_us_per_op'),1)} ({f(g(e,w,'client_cpu_us_per_op'),1)} + {f(g(e,w,'server_cpu_us_per_op'),1)})" for e in eng) + " |")
print()
print("| after | " + " | ".join(f"{e}" for e in eng) + " | kv ÷ rocksdb-lz4 |")
print("|---|"+"---|"*(len(eng)+1))
for w in ["load","D"]:
    for k,name in [("logical_bytes","logical (store's slots / RocksDB's files)"),("mapped_bytes","zdisk mapped"),("stored_bytes","zdisk stored (physical)"),("physical_used_bytes","zdisk physical used, garbage included")]:
        print(f"| {w}: {name} MB | " + " | ".join(f(g(e,w,k)/1e6,1) for e in eng) + f" | {g('kv',w,k)/g('rocksdb-lz4',w,k):.2f}× |")
print(f"| driver RSS, largest MB | " + " | ".join(f(max(g(e,w,'rss_bytes') for w in wl)/1e6,1) for e in eng) + " | |")
print(f"| zdisk serve RSS, largest MB | " + " | ".join(f(max(g(e,w,'server_rss_bytes') or 0 for w in wl)/1e6,1) for e in eng) + " | |")
print()
print("| bytes written per operation, host / media | " + " | ".join(eng) + " |")
print("|---|"+"---|"*len(eng))
cells=[]
for e in eng:
    ops=g(e,'load','operations')
    cells.append(f"{f(g(e,'load','host_write_bytes')/ops)} / {f(g(e,'load','media_write_bytes')/ops)}")
print("| load (per pair) | " + " | ".join(cells) + " |")
cells=[]
for e in eng:
    writes=sum(g(e,w,'operations')-g(e,w,'reads') for w in ['A','B','D'])+g(e,'F','operations')/2
    cells.append(f"{f((g(e,'D','host_write_bytes')-g(e,'load','host_write_bytes'))/writes)} / {f((g(e,'D','media_write_bytes')-g(e,'load','media_write_bytes'))/writes)}")
print("| A, B, C, F, D together (per update or insert) | " + " | ".join(cells) + " |")
