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

Each round also measures a floor: what any verified cross-host read of the same
chunks must do at least, without kvfs (:func:`_floor`). It reads the round's
tier objects with librados from the root namespace, as ``rados bench`` does, on
as many threads, and checks every block's keyed name (the tier's own HMAC); a
second pass also places each chunk in the page cache and reads it into the
reader's buffer, as a plain read() gets its bytes; a third keeps each chunk in a
file beside the stores and reads it back with O_DIRECT, as the bypass client
does. No pass has a daemon, a FUSE request or a store in the way.
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


FLOORS = ("fetch_verify", "fetch_verify_page_cache_read", "fetch_verify_keep_read_direct")


def _floor(cluster, tenant, key, names, buffers, datas, threads, readers, scratch):
    """The floor of one round (module doc): {pass: {gb_s, cpu_s_per_gb}} for FLOORS.

    * fetch_verify: each block read with librados and checked against its name.
    * ..._page_cache_read: each checked block also written into a file on /dev/shm
      (tmpfs: a copy into newly allocated page-cache pages, as kvfs's page fill
      makes), then each file read whole into its buffer (plain reads).
    * ..._keep_read_direct: each checked block also written with O_DIRECT into a
      file beside the hosts' stores (the local copy the tier keeps), then each file
      read back with O_DIRECT into its buffer and every block hashed with xxh3 (the
      bypass client's reads and key checks).

    A pass's time is the sum of its two steps: the fetch on ``threads`` threads (as
    ``rados bench -t``), the read-out on ``readers``."""
    import xxhash

    from ceph_cluster import POOL
    from kvfs.tier.names import TenantNames, load_secret
    from kvfs.tier.rados import load_rados
    rados = load_rados()
    ceph_id, keyring = cluster.add_tenant(tenant)
    conn = rados.Rados(conffile=str(cluster.client_conf(ceph_id, keyring)), rados_id=ceph_id)
    conn.connect(timeout=10)
    shm = Path(tempfile.mkdtemp(prefix="kvfs-bench-floor-", dir="/dev/shm"))
    direct_files = [scratch / f"floor-c{c}" for c in range(len(names))]
    # Per pass: where the chunks are placed (None: nowhere), and whether with O_DIRECT.
    placements = {FLOORS[0]: (None, False),
                  FLOORS[1]: ([shm / f"c{c}" for c in range(len(names))], False),
                  FLOORS[2]: (direct_files, True)}
    try:
        ioctx = conn.open_ioctx(POOL)
        ioctx.set_namespace(tenant)
        tn = TenantNames(tenant, load_secret(str(key)))
        paths = [b"/" + name.encode() for name in names]
        manifests = [tn.decode_manifest(ioctx.read(tn.manifest_name(p), 1 << 20), p) for p in paths]
        jobs = [(c, i) for c, m in enumerate(manifests) for i in range(len(m.blocks))]
        total = sum(m.size for m in manifests)
        block_size = max(m.block_size for m in manifests)
        out = {}
        for floor, (files, direct) in placements.items():
            flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
            fds = [os.open(path, flags, 0o600) for path in files or ()]
            hashes = {}

            def fetch(staging, job):
                c, i = job
                m = manifests[c]
                data = ioctx.read(m.blocks[i], m.block_size + 1)
                if len(data) != TenantNames.block_length(m, i) or tn.block_name(data) != m.blocks[i]:
                    raise bl.BenchError(f"floor: block {i} of {names[c]} does not verify")
                if not fds:
                    return
                if direct:
                    hashes[job] = xxhash.xxh3_128_digest(data)
                    staging[:len(data)] = data
                    written = min(len(data), os.pwrite(fds[c], memoryview(staging)[:bl.round_up(len(data))],
                                                       i * m.block_size))
                else:
                    written = os.pwrite(fds[c], data, i * m.block_size)
                if written != len(data):
                    raise bl.ShortIO(f"floor: short write ({names[c]})")

            def read_out(_state, c):
                size = manifests[c].size
                view = memoryview(buffers[c])
                if os.preadv(fds[c], [view[:bl.round_up(size) if direct else size]], 0) < size:
                    raise bl.ShortIO(f"floor: short read ({names[c]})")
                if direct:
                    bs = manifests[c].block_size
                    for i in range(len(manifests[c].blocks)):
                        if xxhash.xxh3_128_digest(view[i * bs:min(size, (i + 1) * bs)]) != hashes[(c, i)]:
                            raise bl.BenchError(f"floor: block {i} of {names[c]} read back wrong")
            try:
                bl.drop_kernel_caches()
                seconds, cpu = bl.run_parallel(jobs, threads, fetch, setup=lambda: bl.aligned_buffer(block_size))
                if fds:
                    more_s, more_cpu = bl.run_parallel(range(len(manifests)), readers, read_out)
                    seconds, cpu = seconds + more_s, cpu + more_cpu
                    for c, data in enumerate(datas):
                        if buffers[c][:len(data)] != data:
                            raise bl.BenchError(f"floor: {names[c]} differs from what A wrote")
            finally:
                for fd in fds:
                    os.close(fd)
            out[floor] = {"gb_s": round(total / seconds / 1e9, 3),
                          "cpu_s_per_gb": round(bl.cpu_s_per_gb(cpu, total), 3)}
        ioctx.close()
        return out
    finally:
        conn.shutdown()
        bl.remove_tree(shm)
        for path in direct_files:
            path.unlink(missing_ok=True)


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


def _round(a, b, n, chunks, chunk_bytes, readers, client, floor):
    """One round on fresh names: A writes and publishes, B reads cold, then again locally;
    then the floor (``floor(names, buffers, datas)``) on the same objects."""
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
    floors = floor(names, buffers, datas)
    total = chunks * chunk_bytes
    opens.sort()
    return {
        **{f"floor_{name}": figures for name, figures in floors.items()},
        "write_on_a_s": round(write_s, 3), "published_on_a_after_s": round(publish_s, 3),
        "cold_gb_s": round(total / cold_s / 1e9, 3), "cold_cpu_s_per_gb": round(bl.cpu_s_per_gb(cold_cpu, total), 3),
        "open_ms_median": round(opens[len(opens) // 2] * 1000, 1), "open_ms_max": round(opens[-1] * 1000, 1),
        "second_read_gb_s": round(total / local_s / 1e9, 3),
        "second_read_cpu_s_per_gb": round(bl.cpu_s_per_gb(local_cpu, total), 3),
        "second_read_bytes_from_tier": after["tier_fetched_bytes"] - cold["tier_fetched_bytes"],
        "fetched_bytes": cold["tier_fetched_bytes"] - before["tier_fetched_bytes"],
        "verify_failures": after["tier_verify_failures"] - before["tier_verify_failures"],
        # Both reads: how many chunks the client read from B's device itself, the READ
        # requests that carried bytes through pyfuse3, the bytes B's opens placed in the
        # kernel's page cache (pyfuse3 alone: plain reads then send no READ at all), and
        # the bytes the native read plane answered (on by default for root mounts).
        "block_maps_served": after["block_maps_served"] - before["block_maps_served"],
        "fuse_read_requests": after["kernel_read_requests"] - before["kernel_read_requests"],
        "page_fill_bytes": after["page_fill_bytes"] - before["page_fill_bytes"],
        "native_read_bytes": after.get("native_read_bytes", 0) - before.get("native_read_bytes", 0),
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
            one = _round(a, b, n, chunks, chunk_bytes, readers, client,
                         lambda names, buffers, datas: _floor(cluster, "bench", key, names, buffers, datas,
                                                              rados_threads, readers, scratch))
            log(f"round {n}: rados bench ...")
            one["rados_bench"] = _rados_bench(cluster, rados_seconds, rados_threads)
            seq = one["rados_bench"]["seq_read_gb_s"]
            one["cold_vs_rados_seq"] = round(one["cold_gb_s"] / seq, 3) if seq else None
            for floor in FLOORS:
                one[f"floor_{floor}"]["vs_rados_seq"] = round(one[f"floor_{floor}"]["gb_s"] / seq, 3) if seq else None
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
            # The floor (module doc): what a verified cross-host read costs without kvfs.
            **{f"floor_{floor}_{key}": med(key, f"floor_{floor}")
               for floor in FLOORS for key in ("gb_s", "cpu_s_per_gb", "vs_rados_seq")},
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
