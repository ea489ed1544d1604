"""kvfs-bench tier: cross-host reads through the shared tier vs ``rados bench`` on the same cluster.

Starts the test harness's Ceph cluster (tests/ceph_cluster.py: one mon, two memstore
OSDs, in a network namespace) and two kvfs hosts, A and B, each a daemon and a store
in a network namespace of its own. A writes N chunk files and publishes them; B,
with an empty store, reads each chunk by name (cold: its lookup fetches and verifies
the blocks from the tier), then reads them all again (local: 0 bytes from the tier,
checked), with ``readers`` threads. Then ``rados bench`` writes 1 MiB objects and
reads them back sequentially (the tier's objects are 1 MiB too), from the root
namespace over the same bridge. That is one round; ``repeat`` rounds run on fresh
names in the same cluster, and the figures are their medians, each speed with the
whole machine's busy CPU-seconds per GB (/proc/stat) beside it. Prints one JSON
object; everything is torn down at the end.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
import benchlib as bl  # noqa: E402  (tools/, beside this file)
import kvfs.client  # noqa: E402

MiB = 1 << 20


def log(text):
    print(f"[kvfs-bench tier] {text}", file=sys.stderr, flush=True)


def _drop_caches(host):
    bl.drop_kernel_caches()
    host.admin("drop-caches", host.mnt)


def _rados_bench(cluster, seconds, threads):
    base = ["rados", "-c", str(cluster.conf), "-k", str(cluster.admin_keyring), "-p", "kvpool"]
    write = subprocess.run(base + ["bench", str(seconds), "write", "-b", "1M", "-t", str(threads), "--no-cleanup"],
                           capture_output=True, text=True, timeout=120)
    cpu0 = bl.cpu_busy_seconds()
    seq = subprocess.run(base + ["bench", str(seconds), "seq", "-t", str(threads)],
                         capture_output=True, text=True, timeout=120)
    seq_cpu = bl.cpu_busy_seconds() - cpu0
    subprocess.run(base + ["cleanup"], capture_output=True, text=True, timeout=120)

    def bandwidth(out):
        m = re.search(r"Bandwidth \(MB/sec\):\s+([\d.]+)", out)
        return float(m.group(1)) * 1e6 / 1e9 if m else None      # rados prints MiB-based "MB"/s
    reads = re.search(r"Total reads made:\s+(\d+)", seq.stdout)
    out = {"write_gb_s": bandwidth(write.stdout), "seq_read_gb_s": bandwidth(seq.stdout),
           # The whole machine over the seq run (its start and end included): OSDs and client.
           "seq_read_cpu_s_per_gb": (round(bl.cpu_s_per_gb(seq_cpu, int(reads.group(1)) * MiB), 3)
                                     if reads else None)}
    for name, proc in (("write", write), ("seq", seq)):
        if bandwidth(proc.stdout) is None:
            out[f"{name}_error"] = (proc.stderr.strip() or proc.stdout.strip())[-300:]
    return out


def _read_all(host, paths, buffers, datas, readers, client, what):
    """Drop the caches, then read every file whole into its buffer, ``readers`` threads
    each taking the next path, and check the bytes once the clock has stopped (hashing
    both sides in the loop cost ~90 ms a chunk). Returns the read's Timed and each
    open's seconds (the open is where a cross-host lookup fetches; with ``client``,
    kvfs.client.read_into, the reads of the engine plugins, timed whole)."""
    size = len(datas[0])
    opens = [0.0] * len(paths)

    def read_one(_state, i):
        t0 = time.monotonic()
        if client:
            got = kvfs.client.read_into(paths[i], buffers[i])
            opens[i] = time.monotonic() - t0
        else:
            fd = os.open(paths[i], os.O_RDONLY)
            try:
                opens[i] = time.monotonic() - t0
                got = os.readv(fd, [memoryview(buffers[i])[:size]])
            finally:
                os.close(fd)
        if got != size:
            raise bl.ShortIO(f"{paths[i]}: {got} of {size} bytes")

    _drop_caches(host)
    timing = bl.run_parallel(range(len(paths)), readers, read_one)
    for path, buf, data in zip(paths, buffers, datas):
        if buf[:size] != data:
            raise bl.BenchError(f"{path} {what} on B differs from what A wrote")
    return timing, opens


def _round(a, b, n, chunks, chunk_bytes, readers, client):
    """One round on fresh names: A writes and publishes, B reads cold, then again locally."""
    datas = [os.urandom(chunk_bytes) for _ in range(chunks)]
    names = [f"round{n}-chunk-{i:04d}.bin" for i in range(chunks)]
    published = a.stats()["tier_published_files"]
    t0 = time.monotonic()
    for name, data in zip(names, datas):
        with open(a.mnt / name, "wb") as f:
            f.write(data)
    write_s = time.monotonic() - t0
    while a.stats()["tier_published_files"] < published + chunks:
        if time.monotonic() - t0 > 300:
            raise RuntimeError(f"A published {a.stats()['tier_published_files'] - published} of {chunks} in 300 s")
        time.sleep(0.02)
    publish_s = time.monotonic() - t0
    log(f"round {n}: A wrote {chunks} x {chunk_bytes / MiB:g} MiB in {write_s:.2f} s, "
        f"all published after {publish_s:.2f} s")
    # An engine reads into memory it holds (LMCache's memory objects, SGLang's host pool):
    # the buffers are faulted in before the clock, so the figures are the filesystem's,
    # not the page faults of a fresh allocation (~0.8 CPU-s/GB here).
    buffers = [bl.aligned_buffer(chunk_bytes) for _ in range(chunks)]
    paths = [b.mnt / name for name in names]
    before = b.stats()
    (cold_s, cold_cpu), opens = _read_all(b, paths, buffers, datas, readers, client, "read")
    cold = b.stats()
    if cold["tier_hits"] - before["tier_hits"] != chunks:
        raise RuntimeError(f"B found {cold['tier_hits'] - before['tier_hits']} of {chunks} chunks in the tier")
    (local_s, local_cpu), _ = _read_all(b, paths, buffers, datas, readers, client, "read again")
    after = b.stats()
    total = chunks * chunk_bytes
    opens.sort()
    return {
        "write_on_a_s": round(write_s, 3), "published_on_a_after_s": round(publish_s, 3),
        "cold_gb_s": round(total / cold_s / 1e9, 3), "cold_cpu_s_per_gb": round(bl.cpu_s_per_gb(cold_cpu, total), 3),
        "open_ms_median": round(opens[len(opens) // 2] * 1000, 1), "open_ms_max": round(opens[-1] * 1000, 1),
        "second_read_gb_s": round(total / local_s / 1e9, 3),
        "second_read_cpu_s_per_gb": round(bl.cpu_s_per_gb(local_cpu, total), 3),
        "second_read_bytes_from_tier": after["tier_fetched_bytes"] - cold["tier_fetched_bytes"],
        "fetched_bytes": cold["tier_fetched_bytes"] - before["tier_fetched_bytes"],
        "verify_failures": after["tier_verify_failures"] - before["tier_verify_failures"],
        # Both reads: how many chunks the client read from B's device itself, the READ
        # requests that carried bytes through FUSE, and the bytes B's opens placed in
        # the kernel's page cache (plain reads then send no READ at all).
        "block_maps_served": after["block_maps_served"] - before["block_maps_served"],
        "fuse_read_requests": after["kernel_read_requests"] - before["kernel_read_requests"],
        "page_fill_bytes": after["page_fill_bytes"] - before["page_fill_bytes"],
    }


def run(*, chunks=8, chunk_bytes=32 * MiB, workdir="/tmp", rados_seconds=3, rados_threads=16, keep=False,
        repeat=3, readers=1, client=False):
    from ceph_cluster import CephCluster, make_host, tenant_key, tier_options
    scratch = Path(tempfile.mkdtemp(prefix="kvfs-bench-tier-", dir=workdir))
    memstore = max(2048, (repeat * chunks * chunk_bytes * 2) // MiB + 1024)
    cluster = CephCluster(memstore_mib=memstore)
    hosts = []
    try:
        cluster.start()
        log(f"cluster up in {cluster.started_s:.1f} s")
        key = tenant_key(scratch, "bench")
        store = max(4 << 30, repeat * chunks * chunk_bytes * 2)
        for name in ("a", "b"):
            ns = cluster.add_host(name)[0]
            host = make_host(scratch / name, ns, tier_options(cluster, "bench", key), size=str(store))
            host.mount()
            hosts.append(host)
        a, b = hosts
        rounds = []
        for n in range(repeat):
            one = _round(a, b, n, chunks, chunk_bytes, readers, client)
            log(f"round {n}: rados bench ...")
            one["rados_bench"] = _rados_bench(cluster, rados_seconds, rados_threads)
            seq = one["rados_bench"]["seq_read_gb_s"]
            one["cold_vs_rados_seq"] = round(one["cold_gb_s"] / seq, 3) if seq else None
            log(f"round {n}: cold {one['cold_gb_s']} GB/s, rados seq {seq} GB/s")
            rounds.append(one)
        if any(r["second_read_bytes_from_tier"] for r in rounds):
            raise RuntimeError("a second read on B fetched from the tier")

        def med(key, sub=None):
            return bl.median([(r[sub] if sub else r)[key] for r in rounds])
        out = {
            "chunks": chunks, "chunk_bytes": chunk_bytes, "readers": readers, "repeat": repeat,
            "reader": "kvfs.client.read_into" if client else "open + readinto",
            "cluster_start_s": round(cluster.started_s, 2),
            "cross_host_cold_read_gb_s": med("cold_gb_s"),
            "cross_host_cold_read_cpu_s_per_gb": med("cold_cpu_s_per_gb"),
            "cross_host_open_ms_median": med("open_ms_median"),
            "second_read_on_b_gb_s": med("second_read_gb_s"),
            "second_read_on_b_cpu_s_per_gb": med("second_read_cpu_s_per_gb"),
            "second_read_bytes_from_tier": sum(r["second_read_bytes_from_tier"] for r in rounds),
            "published_on_a_after_s": med("published_on_a_after_s"),
            "rados_bench_seq_read_gb_s": med("seq_read_gb_s", "rados_bench"),
            "rados_bench_seq_read_cpu_s_per_gb": med("seq_read_cpu_s_per_gb", "rados_bench"),
            "rados_bench": {"object_bytes": MiB, "threads": rados_threads, "seconds": rados_seconds},
            "cold_vs_rados_seq": med("cold_vs_rados_seq"),
            "goal_cold_vs_rados_seq": 0.5,
            "rounds": rounds,
        }
        return out, 0
    finally:
        for host in hosts:
            try:
                host.umount()
            except Exception as exc:        # noqa: BLE001  (teardown goes on)
                log(f"unmount {host.mnt}: {exc}")
                subprocess.run(["fusermount3", "-uz", str(host.mnt)], capture_output=True)
        cluster.stop()
        if not keep:
            subprocess.run(["rm", "-rf", str(scratch)])
